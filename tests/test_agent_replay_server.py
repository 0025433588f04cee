"""`minakv bench replay` end to end on CPU: 2 tasks x 5 rounds of synthetic trajectories through a real
tiny-gpt-oss server with the openai client, under `plain` and `kv_drop:K=2`.

A middleware records every request body the server receives. Checked:

- each task's requests are serial turns of one growing history: round r + 1 sends round r's messages plus
  the model's answer (streamed back, folded in) and the trajectory's tool results, one per recorded call;
- the operations sent are exactly the policy's (`CachePolicy.ops` of the messages sent), plain sends none;
- usage adds up: prompt - cached - drop-skipped, summed over a policy's requests, is what the engine
  counted as computed (its prefill counter, read from /metrics by the replay and from engine.stats() here);
- what kv_drop buys: a shorter active context, fewer KV bytes read per decode token and a smaller bill
  (billing the active context) than plain, on the same trajectories;
- the JSON, the request log and (when matplotlib is importable) the PNGs are written.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
from aiohttp import web
from helpers.server import ServerThread, wait_idle

from minakv.agent import CachePolicy
from minakv.agent.replay.trajectory import read_jsonl
from minakv.cli import main
from minakv.engine import Engine
from minakv.server.app import make_app

MODEL = "tiny-gpt-oss"
ROUNDS, OUTPUT = 5, 6


@pytest.fixture(scope="module")
def server():
    engine = Engine(MODEL, kv_cache_tokens=16384, max_model_len=4096)
    app = make_app(engine)
    received: dict[str, list[dict]] = {}

    @web.middleware
    async def record(request: web.Request, handler):
        if request.path == "/v1/chat/completions":
            body = json.loads(await request.read())  # aiohttp keeps the body for the handler
            received.setdefault(body.get("user"), []).append(body)
        return await handler(request)

    app.middlewares.append(record)
    thread = ServerThread(app)
    yield engine, f"http://127.0.0.1:{thread.port}", received
    thread.stop()


def test_replay_plain_vs_kv_drop(server, tmp_path) -> None:
    engine, url, received = server
    before = wait_idle(engine)
    argv = ["bench", "replay", "--url", url, "--tasks", "2", "--rounds", str(ROUNDS), "--synthetic",
            "--tool-tokens", "40", "--max-tool-tokens", "160", "--system-tokens", "48", "--user-tokens", "16",
            "--output-tokens", str(OUTPUT), "--parallel", "0.3", "--seed", "5",
            "--policies", "plain,kv_drop:K=2", "--out", str(tmp_path), "--no-progress",
            "--salt", "7"]  # fmt: skip
    assert main(argv) == 0  # the model name comes from /v1/models
    after = wait_idle(engine)

    trajectories = {t.id: t for t in read_jsonl(tmp_path / "trajectories.jsonl")}
    assert len(trajectories) == 2
    policy = CachePolicy(keep_tool_results=2)
    for label in ("plain", "kv_drop:K=2"):
        for tid, t in trajectories.items():
            bodies = received[f"{label}/{tid}"]
            assert len(bodies) == ROUNDS
            for r, body in enumerate(bodies):
                assert body["stream"] and body["ignore_eos"] and body["max_tokens"] == OUTPUT
                assert body["model"] == MODEL and body["tools"] == t.tools
                messages = body["messages"]
                if label == "plain":
                    assert "cache" not in body
                else:
                    assert body["cache"] == policy.ops(messages)
                if r == 0:
                    assert [m["role"] for m in messages] == ["system", "user"]
                    assert messages[1]["content"] == t.user_text()
                    continue
                previous = bodies[r - 1]["messages"]
                assert messages[: len(previous)] == previous  # one history, growing
                answer, results = messages[len(previous)], messages[len(previous) + 1 :]
                assert answer["role"] == "assistant"
                assert len(results) == len(answer["tool_calls"]) == len(t.turns[r - 1].tool_results)
                for k, (res, call) in enumerate(zip(results, answer["tool_calls"], strict=True)):
                    assert res == {
                        "role": "tool",
                        "tool_call_id": call["id"],
                        "content": t.result_text(r - 1, k),
                    }
        if label != "plain":
            assert any(b["cache"]["drop"] for b in bodies)  # the window did roll

    data = json.loads((tmp_path / "replay.json").read_text())
    rows = {s["policy"]: s for s in data["policies"]}
    assert data["meta"]["model"] == MODEL and data["meta"]["token_counter"]
    for s in rows.values():
        p = s["prefill"]
        assert s["requests"] == 2 * ROUNDS and s["decode"]["logical"] == 2 * ROUNDS * OUTPUT
        assert p["actual"] == p["logical"] - p["cached"] - p["drop_skipped"] == p["server_actual"]
        assert p["cached"] > 0 and s["active_exact"]
        assert s["ttft_ms"]["p50"] > 0 and s["server"]["server_tpot_ms"] > 0
        assert len(s["per_round"]["cumulative_cost"]) == ROUNDS
    # the engine's own counter agrees with the usage fields over both policies
    computed = sum(s["prefill"]["actual"] for s in rows.values())
    assert after["prefill_tokens"] - before["prefill_tokens"] == computed

    plain, kv = rows["plain"], rows["kv_drop:K=2"]
    assert kv["per_round"]["active_tokens"][-1] < plain["per_round"]["active_tokens"][-1]
    assert kv["kv_bytes_per_decode_token"] < plain["kv_bytes_per_decode_token"]
    assert kv["cost"]["total"] < plain["cost"]["total"]
    # what kv_drop does not change: the same trajectories are sent and reuse the cache as well as plain's
    # do (each request computes only what is new since the task's last one; the two differ only by the
    # length of the model's own answers)
    assert abs(kv["prefill"]["actual"] - plain["prefill"]["actual"]) < 0.1 * plain["prefill"]["actual"]

    lines = (tmp_path / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 2 * ROUNDS
    pngs = {"latency.png", "active_context.png", "cost.png"}
    written = {p.name for p in tmp_path.glob("*.png")}
    assert written == (pngs if importlib.util.find_spec("matplotlib") else set())
