"""`minakv serve` against real clients: the `openai` package (and raw aiohttp for disconnects) talking to the
server over a real socket, on the tiny MiniMax-M2 preset. One engine and one server for the module; the
server runs in a background thread with its own event loop, so the test can also call the same engine's
`generate` (the reference for greedy outputs) and its pool check (`engine.check()`).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import aiohttp
import openai
import pytest
from helpers.server import ServerThread, chat_bytes, greedy, hand_thinking_drop, token_bytes, wait_idle

from minakv.engine import Engine
from minakv.params import SamplingParams
from minakv.server.app import make_app

MODEL = "tiny-minimax-m2"
NAME = "mm-test"
KEY = "sekret"
MAX_LEN = 256

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
HISTORY = [
    {"role": "system", "content": "you help"},
    {"role": "user", "content": "what is the weather in the city"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "call the tool",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny today"},
    {"role": "user", "content": "and the answer"},
]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(MODEL, kv_cache_tokens=4096, max_model_len=MAX_LEN, max_queued_requests=64)


@pytest.fixture(scope="module")
def server(engine: Engine):
    srv = ServerThread(make_app(engine, NAME, api_key=KEY, max_body_bytes=64 << 10))
    srv.url = f"http://127.0.0.1:{srv.port}"
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


# ---------------------------------------------------------------------------------------------------------
# Good requests


def test_chat_non_streamed_equals_generate(engine: Engine, client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "hello world"}]
    resp = client.chat.completions.create(
        model=NAME, messages=msgs, max_tokens=6, temperature=0, logprobs=True
    )
    ref = greedy(engine, {"messages": msgs}, 6)
    assert chat_bytes(resp) == token_bytes(engine, ref)
    assert resp.usage.completion_tokens == len(ref) and resp.usage.prompt_tokens > 0
    assert resp.choices[0].finish_reason in ("length", "stop")
    assert resp.object == "chat.completion" and resp.model == NAME


def test_chat_streamed_matches_non_streamed(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "what is the cache"}]
    kwargs = {"model": NAME, "messages": msgs, "max_tokens": 6, "temperature": 0}
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
    )
    message = full.choices[0].message
    assert content == (message.content or "")
    assert reasoning == (getattr(message, "reasoning_content", None) or "")
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # streamed logprobs: the same tokens as the non-streamed ones
    lp_full = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=2)
    lp_chunks = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=2, stream=True)
    streamed = [
        t for c in lp_chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content
    ]
    assert [(t.token, t.bytes) for t in streamed] == [
        (t.token, t.bytes) for t in lp_full.choices[0].logprobs.content
    ]
    assert all(len(t.top_logprobs) == 2 for t in streamed)
    # without include_usage (and no cache operations) there is no usage chunk
    plain = list(client.chat.completions.create(**kwargs, stream=True))
    assert all(c.usage is None for c in plain)


def test_completions_text_and_token_ids(engine: Engine, client: openai.OpenAI) -> None:
    ids = engine.tokenizer.encode("hello world the cache")
    ref = engine.generate([ids], SamplingParams(max_tokens=5, temperature=0))[0]
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=5, temperature=0)
    by_text = client.completions.create(
        model=NAME, prompt="hello world the cache", max_tokens=5, temperature=0
    )
    assert by_ids.choices[0].text == by_text.choices[0].text == ref.text
    assert by_ids.usage.prompt_tokens == len(ids) and by_ids.usage.completion_tokens == len(ref.token_ids)
    streamed = list(
        client.completions.create(
            model=NAME,
            prompt=ids,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == ref.text
    assert streamed[-1].choices == [] and streamed[-1].usage.completion_tokens == len(ref.token_ids)
    lp = client.completions.create(model=NAME, prompt=ids, max_tokens=3, temperature=0, logprobs=2)
    assert len(lp.choices[0].logprobs.token_logprobs) == 3
    assert all(len(top) >= 1 for top in lp.choices[0].logprobs.top_logprobs)


def test_tool_call_history_equals_generate(engine: Engine, client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=NAME, messages=HISTORY, tools=TOOLS, max_tokens=5, temperature=0, logprobs=True
    )
    ref = greedy(engine, {"messages": HISTORY, "tools": TOOLS}, 5)
    assert chat_bytes(resp) == token_bytes(engine, ref)
    # the history really reached the template: the prompt holds the tool call, the result and the tools
    from minakv.text.chat import render

    rendered = render(HISTORY, engine.tokenizer, tools=TOOLS)
    assert resp.usage.prompt_tokens == len(rendered.token_ids)
    assert "get_weather" in rendered.text and "sunny today" in rendered.text and "Paris" in rendered.text


def test_cache_operations_both_forms(engine: Engine, client: openai.OpenAI) -> None:
    ops = {"drop": {"3": [1, 2, 3]}, "reposition": [3]}
    prompt = {"messages": HISTORY, "tools": TOOLS, "cache": ops}
    ref = greedy(engine, prompt, 5)
    bodies = [
        {"cache": ops},
        {"drop_message": ops["drop"], "reposition": [3]},
        {"drop_rule": {"type": "message_drop", "drop_messages": ops["drop"]}, "reposition": [3]},
    ]
    base = {
        "model": NAME,
        "messages": HISTORY,
        "tools": TOOLS,
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": True,
    }
    for extra in bodies:
        resp = client.chat.completions.create(**base, extra_body=extra)
        assert chat_bytes(resp) == token_bytes(engine, ref), extra
        details = resp.usage.prompt_tokens_details.model_dump()
        assert set(details) >= {"cached_tokens", "repos_tokens", "drop_skipped_tokens"}
        assert all(
            isinstance(details[k], int) for k in ("cached_tokens", "repos_tokens", "drop_skipped_tokens")
        )
        # the same numbers as the engine reports for the same request in the same (warm) cache state
        again = engine.generate([prompt], SamplingParams(max_tokens=5, temperature=0))[0].usage
        assert (resp.usage.prompt_tokens, details["cached_tokens"], details["repos_tokens"]) == (
            again.prompt_tokens, again.cached_tokens, again.repos_tokens,
        )  # fmt: skip
        assert details["drop_skipped_tokens"] == again.drop_skipped_tokens
        # streamed: the usage chunk comes without include_usage, details included
        chunks = list(client.chat.completions.create(**base, extra_body=extra, stream=True))
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == len(ref)
        assert usage.prompt_tokens_details.model_dump() == details


def test_cache_operation_zeros_reported(client: openai.OpenAI) -> None:
    msgs = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "x"},
    ]
    resp = client.chat.completions.create(
        model=NAME, messages=msgs, max_tokens=2, extra_body={"drop_message": {}}
    )
    raw = resp.usage.prompt_tokens_details.model_dump()
    assert raw["repos_tokens"] == 0 and raw["drop_skipped_tokens"] == 0 and "cached_tokens" in raw


def test_thinking_drop_drops_reasoning_segment(engine: Engine, client: openai.OpenAI) -> None:
    msgs = [
        {"role": "user", "content": "what is the weather"},
        {"role": "assistant", "content": "it is sunny", "reasoning_content": "think about the weather"},
        {"role": "user", "content": "and today"},
    ]
    prompt, length = hand_thinking_drop(engine.tokenizer, msgs, 1, "think about the weather")
    assert (
        len(prompt["message_tokens"]) == 6
    )  # user, header, reasoning, rest of message 1, user, generation prompt
    ref = greedy(engine, prompt, 4)
    base = {"model": NAME, "messages": msgs, "max_tokens": 4, "temperature": 0, "logprobs": True}
    resp = client.chat.completions.create(**base, extra_body={"drop_rule": {"type": "thinking_drop"}})
    assert chat_bytes(resp) == token_bytes(engine, ref)
    assert resp.usage.prompt_tokens == length


def test_models_health_metrics(server, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]
    with urllib.request.urlopen(server.url + "/health") as r:
        assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}
    with urllib.request.urlopen(server.url + "/metrics") as r:
        text = r.read().decode()
    for name in (
        "minakv_requests",
        "minakv_prompt_tokens",
        "minakv_output_tokens",
        "minakv_cache_hit_tokens",
        "minakv_pages_used",
        "minakv_pages_free",
        "minakv_evictions",
        "minakv_kv_bytes_read_per_decode_token",
    ):
        assert f"\n{name} " in text, name
    assert 'minakv_http_responses_total{route="/v1/chat/completions",status="200"}' in text


def test_concurrent_streaming_clients(engine: Engine, server) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, str | None]:
        stream = await client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        tokens, finish = 0, None
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        return tokens, finish

    async def main() -> list[tuple[int, str | None]]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(32)))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert len(results) == 32 and all(f is not None and 1 <= n <= 4 for n, f in results)
    wait_idle(engine)


def test_disconnects_abort_and_free_pages(engine: Engine, server) -> None:
    baseline = wait_idle(engine)
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 200,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {KEY}"}

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            # streams cut after their first chunk
            for _ in range(3):
                resp = await session.post(
                    server.url + "/v1/chat/completions", json={**body, "stream": True}, headers=headers
                )
                assert resp.status == 200
                await resp.content.readline()
                resp.close()
            # a non-streamed request whose client gives up
            with pytest.raises(asyncio.TimeoutError):
                await session.post(
                    server.url + "/v1/chat/completions",
                    json=body,
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=0.5),
                )

    async def queued() -> None:
        """With one running slot taken, a request waits in the queue; its client leaves before its first
        token, so it is aborted while waiting."""
        async with aiohttp.ClientSession() as session:
            running = await session.post(
                server.url + "/v1/chat/completions", json={**body, "stream": True}, headers=headers
            )
            await running.content.readline()
            with pytest.raises(asyncio.TimeoutError):
                await session.post(
                    server.url + "/v1/chat/completions",
                    json={**body, "messages": [{"role": "user", "content": "waiting"}]},
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=0.5),
                )
            deadline = time.monotonic() + 3  # the abort reaches the engine thread on its next loop
            while engine.stats()["waiting"] and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            stats = engine.stats()
            assert (stats["waiting"], stats["running"]) == (0, 1)  # gone while the first one still runs
            running.close()

    asyncio.run(main())
    saved = engine.config.max_num_seqs
    engine.config.max_num_seqs = 1
    try:
        asyncio.run(queued())
    finally:
        engine.config.max_num_seqs = saved
    stats = wait_idle(engine)
    assert stats["output_tokens"] - baseline["output_tokens"] < 5 * 200  # they stopped early
    # the pages of the aborted requests are free again (the cache may keep finished, published pages)
    assert stats["pages_used"] == stats["pages_cached"]


def test_overload_answers_503(engine: Engine, server) -> None:
    wait_idle(engine)
    saved = engine.config.max_queued_requests
    engine.config.max_queued_requests = 2

    async def main() -> list[int]:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as session:

            async def one(i: int) -> int:
                body = {"model": NAME, "messages": [{"role": "user", "content": f"x {i}"}], "max_tokens": 2}
                async with session.post(server.url + "/v1/chat/completions", json=body) as resp:
                    if resp.status == 503:
                        err = (await resp.json())["error"]
                        assert err["type"] == "server_error" and "overloaded" in err["message"]
                    return resp.status

            return await asyncio.gather(*(one(i) for i in range(24)))

    try:
        statuses = asyncio.run(main())
    finally:
        engine.config.max_queued_requests = saved
    assert set(statuses) <= {200, 503} and 503 in statuses and 200 in statuses
    wait_idle(engine)


def test_engine_failure_is_a_500_and_the_server_goes_on(
    engine: Engine, client: openai.OpenAI, monkeypatch
) -> None:
    """A step that raises once is retried with its requests one by one (Scheduler.quarantine): the client
    never notices. A request whose step fails again when it runs alone gets a 500; the server goes on."""
    wait_idle(engine)
    real_step = engine.worker.launch
    fail = {"next": 1}

    def failing_step(batch):
        if fail["next"]:
            fail["next"] -= 1
            raise RuntimeError("injected failure")
        return real_step(batch)

    monkeypatch.setattr(engine.worker, "launch", failing_step)
    msgs = [{"role": "user", "content": "fail once"}]
    resp = client.chat.completions.create(
        model=NAME, messages=msgs, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.usage.completion_tokens == 3  # failed once, retried alone, finished
    fail["next"] = 2  # fails, and fails again alone: this request is the cause
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model=NAME, messages=msgs, max_tokens=3)
    assert info.value.status_code == 500 and "engine failed" in info.value.body["message"]
    fail["next"] = 2
    with pytest.raises(openai.InternalServerError):  # streamed requests get the same 500
        client.chat.completions.create(model=NAME, messages=msgs, max_tokens=3, stream=True)
    resp = client.chat.completions.create(
        model=NAME, messages=msgs, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.usage.completion_tokens == 3
    wait_idle(engine)


def test_requests_beyond_the_running_limit_wait_their_turn(engine: Engine, server, monkeypatch) -> None:
    """With room for 2 running requests, 8 concurrent ones queue and all complete (no 503 below the
    queue limit)."""
    wait_idle(engine)
    monkeypatch.setattr(engine.config, "max_num_seqs", 2)

    async def main() -> list[int]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        try:
            replies = await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model=NAME, messages=[{"role": "user", "content": f"queue {i}"}], max_tokens=3
                    )
                    for i in range(8)
                )
            )
        finally:
            await client.close()
        return [r.usage.completion_tokens for r in replies]

    assert all(1 <= n <= 3 for n in asyncio.run(main()))
    wait_idle(engine)
