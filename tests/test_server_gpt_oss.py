"""`minakv serve` on the tiny GPT-OSS preset (harmony format, o200k vocabulary) with the `openai` client:
tool-call history, streamed and not, greedy equality with `Engine.generate`, cache operations and
thinking_drop on harmony analysis. The MiniMax-M2 module (test_server_e2e.py) covers the rest."""

from __future__ import annotations

import openai
import pytest
from helpers.server import ServerThread, chat_bytes, greedy, hand_thinking_drop, token_bytes, wait_idle

from minakv.engine import Engine
from minakv.server.app import make_app

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
# An unfinished tool-call turn: harmony keeps its analysis (finished turns lose theirs in the template).
HISTORY = [
    {"role": "user", "content": "what is the weather in Paris"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "call the weather tool",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny today"},
]


@pytest.fixture(scope="module")
def setup():
    engine = Engine("tiny-gpt-oss", kv_cache_tokens=4096, max_model_len=512)
    server = ServerThread(make_app(engine))
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0, timeout=60
    )
    yield engine, client
    server.stop()


def test_tool_history_streamed_and_not(setup) -> None:
    engine, client = setup
    base = {"model": "tiny-gpt-oss", "messages": HISTORY, "tools": TOOLS, "max_tokens": 6, "temperature": 0}
    full = client.chat.completions.create(**base, logprobs=True)
    ref = greedy(engine, {"messages": HISTORY, "tools": TOOLS}, 6)
    assert chat_bytes(full) == token_bytes(engine, ref)
    chunks = list(client.chat.completions.create(**base, stream=True, stream_options={"include_usage": True}))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(
        (c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks if c.choices
    )
    message = full.choices[0].message
    assert content == (message.content or "")
    assert reasoning == ((message.model_extra or {}).get("reasoning_content") or "")
    assert chunks[-1].usage.model_dump()["completion_tokens"] == full.usage.completion_tokens == len(ref)


def test_cache_ops_and_thinking_drop(setup) -> None:
    engine, client = setup
    base = {"model": "tiny-gpt-oss", "messages": HISTORY, "tools": TOOLS, "max_tokens": 4, "temperature": 0}
    ops = {"drop": {"2": [1, 2]}, "reposition": [2]}
    ref = greedy(engine, {"messages": HISTORY, "tools": TOOLS, "cache": ops}, 4)
    for extra in ({"cache": ops}, {"drop_message": ops["drop"], "reposition": ops["reposition"]}):
        resp = client.chat.completions.create(**base, logprobs=True, extra_body=extra)
        assert chat_bytes(resp) == token_bytes(engine, ref)
        assert set(resp.usage.prompt_tokens_details.model_dump()) >= {"repos_tokens", "drop_skipped_tokens"}
    prompt, length = hand_thinking_drop(engine.tokenizer, HISTORY, 1, "call the weather tool", TOOLS)
    ref = greedy(engine, prompt, 4)
    resp = client.chat.completions.create(
        **base, logprobs=True, extra_body={"drop_rule": {"type": "thinking_drop"}}
    )
    assert chat_bytes(resp) == token_bytes(engine, ref) and resp.usage.prompt_tokens == length
    wait_idle(engine)
