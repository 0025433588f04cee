"""Smoke tests of the engine benchmarks: bench/agent_replay.py, decode_sweep.py and throughput.py run with --tiny in a
subprocess (a tiny random model, tiny sizes; CPU here, the GPU where there is one), exit 0, print their
tables and write their JSON rows under $OUT."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def run_script(name: str, args: list[str], out: Path) -> str:
    env = {**os.environ, "OUT": str(out), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(BENCH / name), *args]
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_agent_replay_tiny(tmp_path: Path) -> None:
    args = ["--tiny", "--layers", "2", "--agents", "2", "--rounds", "3", "--keep", "1"]
    stdout = run_script("agent_replay.py", args, tmp_path)
    assert "=== agent replay ===" in stdout and "max position" in stdout
    rows = {r["mode"]: r for r in json.loads((tmp_path / "agent_replay.json").read_text()) if "mode" in r}
    assert set(rows) == {"plain", "kv_drop", "text_drop"}
    for r in rows.values():
        assert len(r["round_wall_s"]) == 3 and r["total_wall_s"] > 0 and r["last_round_wall_s"] > 0
        assert r["ttft_ms"]["mean"] > 0 and r["tpot_ms"]["p90"] > 0 and "gpu_busy_last_round" in r
        assert {
            "prompt_tokens",
            "computed_tokens",
            "cached_tokens",
            "drop_skipped_tokens",
            "repos_tokens",
        } <= set(r["usage"])
        assert {"prefill_tokens", "cache_hit_tokens", "kv_bytes_read_per_decode_token"} <= set(r["engine"])
        assert r["usage"]["cached_tokens"] > 0  # later rounds reuse earlier ones
    plain, kv, text = rows["plain"], rows["kv_drop"], rows["text_drop"]
    assert kv["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] > text["usage"]["prompt_tokens"]
    assert kv["usage"]["repos_tokens"] > 0 and plain["usage"]["repos_tokens"] == 0
    assert kv["max_position"] < plain["max_position"]
    last = "last_round_engine"
    assert kv[last]["kv_bytes_read_per_decode_token"] < plain[last]["kv_bytes_read_per_decode_token"]


def test_decode_sweep_tiny(tmp_path: Path) -> None:
    stdout = run_script("decode_sweep.py", ["--tiny", "--layers", "2", "--batches", "1,2"], tmp_path)
    assert "=== decode sweep" in stdout
    rows = [
        r for r in json.loads((tmp_path / "decode_sweep.json").read_text()) if r["kind"] == "decode_sweep"
    ]
    assert {(r["batch"], r["mode"]) for r in rows} == {(b, m) for b in (1, 2) for m in ("greedy", "sampled")}
    for r in rows:
        assert 0 < r["ms_per_step"] <= r["ms_per_step_median"] and r["tok_s"] > 0
        assert {"fraction_of_bound", "gpu_busy", "graph_replay_ms", "bytes_per_step"} <= set(r)
        assert r["mode"] == "greedy" or r["sampled_over_greedy"] > 0


def test_throughput_tiny(tmp_path: Path) -> None:
    """Every request makes exactly its output tokens (ignore_eos), and the rates follow from them."""
    stdout = run_script("throughput.py", ["--tiny", "--paths", "bf16"], tmp_path)
    assert "output tok/s" in stdout
    (row,) = [r for r in json.loads((tmp_path / "throughput.json").read_text()) if r["kind"] == "throughput"]
    assert row["output_tokens"] == row["requests"] * row["output"]
    assert row["output_tok_s"] == row["output_tokens"] / row["wall_s"]
    # the phases split the run at the last first token: every request has its first token by then
    assert 0 < row["prefill_phase_s"] <= row["wall_s"] and row["decode_phase_s"] >= 0
    assert row["requests"] <= row["prefill_phase_tokens"] <= row["output_tokens"]


def test_bench_mxfp4_tiny(tmp_path: Path) -> None:
    assert "check mxfp4 grouped E=4 T=17 vs fp32 loop" in run_script("bench_mxfp4.py", ["--tiny"], tmp_path)


def test_gemv_sweep_tiny(tmp_path: Path) -> None:
    """Every case of the one-token GEMV sweep runs, each config agreeing with its case's default."""
    stdout = run_script("gemv_sweep.py", ["--tiny"], tmp_path)
    rows = json.loads((tmp_path / "gemv_sweep.json").read_text())
    names = {r["name"].split(" {")[0] for r in rows if r["kind"] == "bench"}
    assert {"moe top-2 T=1", "bf16 qkv 128x72", "bf16 o_proj 72x96"} <= names, names
    assert not [r for r in rows if r["kind"] == "note"], stdout[-2000:]  # no config failed or was left out


def test_agent_replay_max_position_matches_the_program() -> None:
    """The script's message-level walk (it checks positions before building anything) agrees with the
    compiled program of every round's request, in every mode."""
    import numpy as np

    sys.path.insert(0, str(BENCH))
    import agent_replay as ar

    from minakv.cache.program import compile_program

    argv = ["--rounds", "7", "--tool-tokens", "30", "--keep", "2", "--assistant-tokens", "5"]
    args = ar.parse_args([*argv, "--system-tokens", "9", "--user-tokens", "3"])
    for mode in ar.MODES:
        best = 0
        for r in range(args.rounds):
            agent = ar.Agent(0, [[1] * 9, [2] * 3], [[3] * 30] * r)
            for j in range(r):
                agent.append(j, [4] * 5)
            prompt = agent.prompt(r, mode, args.keep)
            lengths = [len(m) for m in prompt["message_tokens"]]
            ops = prompt.get("cache", {})
            owners = np.repeat(np.arange(len(lengths)), lengths)
            program = compile_program(owners, len(lengths), ops.get("drop"), ops.get("reposition"))
            best = max(best, int(program.birth_pos.max()), program.next_pos + args.assistant_tokens - 1)
        assert ar.max_position(mode, args) == best, mode


def test_pd_transfer_tiny(tmp_path: Path) -> None:
    """Two CPU processes over gloo: the engine's KV transfer and the plain sends move the same bytes."""
    stdout = run_script("pd_transfer.py", ["--tiny", "--pages", "4,16", "--repeats", "1"], tmp_path)
    assert "transfer / send" in stdout
    rows = [r for r in json.loads((tmp_path / "pd_transfer.json").read_text()) if r["kind"] == "pd_transfer"]
    assert [r["pages"] for r in rows] == [4, 16]
    for r in rows:
        assert r["mb"] == r["pages"] * 16 * 2 * 2 * 2 * 16 * 2 / 1e6  # K and V, layers, heads, dim, bf16
        assert r["transfer_s"] > 0 and r["send_s"] > 0 and r["send_per_layer_s"] > 0
        assert r["verified"]  # the receiver's pages are the sender's


def test_decode_sweep_tensor_parallel_tiny(tmp_path: Path) -> None:
    """--tp 2 --dummy DIR: the model (a tiny config's shape, random weights) in two worker processes over
    gloo; the bytes bound counts the model on a storage-less copy in the parent."""
    from minakv.presets.tiny import GPT_OSS_CONFIG

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(GPT_OSS_CONFIG))
    args = ["--tiny", "--dummy", str(model), "--tp", "2", "--batches", "1,2", "--modes", "greedy"]
    stdout = run_script("decode_sweep.py", args, tmp_path)
    assert "tp 2, ep 1" in stdout
    rows = [
        r for r in json.loads((tmp_path / "decode_sweep.json").read_text()) if r["kind"] == "decode_sweep"
    ]
    assert [r["batch"] for r in rows] == [1, 2] and all(r["ms_per_step"] > 0 for r in rows)
    assert rows[0]["bytes_per_step"] > 0 and rows[1]["bytes_per_step"] > rows[0]["bytes_per_step"]  # more KV


def test_kill_worker_tiny(tmp_path: Path) -> None:
    """The decode worker (a CPU process) killed mid-run: every stream ends in an error within 5 s, and the
    restarted workers serve again with exact accounting."""
    stdout = run_script("kill_worker.py", ["--tiny"], tmp_path)
    assert "killed the decode worker" in stdout
    (row,) = [
        r for r in json.loads((tmp_path / "kill_worker.json").read_text()) if r["kind"] == "kill_worker"
    ]
    assert row["ended_in_error"] == row["streams"] == 3 and row["last_error_s"] < 5
    assert "decode worker process" in row["error"] and row["served_again"] and row["new_pids"]


def test_pd_replay_tiny(tmp_path: Path) -> None:
    """The agent replay colocated and on a CPU prefill/decode pair: both layouts finish every round, and
    only the pair moves KV between workers."""
    stdout = run_script("pd_replay.py", ["--tiny"], tmp_path)
    assert "colocated" in stdout and "pd " in stdout
    rows = {
        r["layout"]: r
        for r in json.loads((tmp_path / "pd_replay.json").read_text())
        if r["kind"] == "pd_replay"
    }
    assert set(rows) == {"colocated", "pd"}
    assert rows["pd"]["kv_bytes_to_decode"] > 0 and rows["colocated"]["kv_bytes_to_decode"] is None
    for r in rows.values():
        assert r["ttft_ms"]["mean"] > 0 and r["tpot_ms"]["p90"] > 0
