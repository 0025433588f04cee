"""`POST /v1/messages` (the Anthropic Messages API) against the real `anthropic` client over a socket.

Both tiny presets run (MiniMax-M2 first: Anthropic's API is its recommended one). Random weights write
random text, so the tests check shapes and consistency, not content: the streamed events add up to the
final message, a greedy reply equals the same conversation's reply on /v1/chat/completions, and the
server hands the engine exactly the chat messages and cache operations the documented conversion says
(a spy on `engine.stream` records the prompts). A random model never calls a tool, so the tool round trip
scripts the model's output (the family's real markup) by replacing `engine.stream` for one request.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import msgspec
import openai
import pytest
from helpers.server import ServerThread, wait_idle

from minakv.engine import Engine
from minakv.outputs import RequestOutput, Usage
from minakv.params import SamplingParams
from minakv.server.anthropic_input import MessagesRequest, to_chat
from minakv.server.app import make_app
from minakv.text.chat import render

NAME = "served"
GREEDY = {"temperature": 0}  # this SDK has no temperature argument any more; the server still takes it
TOOLS = [
    {
        "name": "get_weather",
        "description": "weather of a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]},
    }
    for t in TOOLS
]
# What each family writes for "thinking, then a get_weather call" (MiniMax's generation prompt opens <think>)
SCRIPTS = {
    "tiny-minimax-m2": "Let me check.\n</think>\n\nChecking.\n<minimax:tool_call>\n"
    '<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n</invoke>\n</minimax:tool_call>',
    "tiny-gpt-oss": "<|channel|>analysis<|message|>Let me check.<|end|><|start|>assistant<|channel|>final"
    "<|message|>Checking.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary "
    '<|constrain|>json<|message|>{"city": "Paris"}<|call|>',
}
RAW_EVENTS = {"message_start", "content_block_start", "content_block_delta", "content_block_stop",
              "message_delta", "message_stop"}  # fmt: skip
TEMPLATES = Path(__file__).resolve().parents[2] / "shared" / "data" / "chat_templates"
REAL_TEMPLATES = {"tiny-minimax-m2": "minimax-m2.jinja", "tiny-gpt-oss": "gpt-oss.jinja"}


@dataclass
class Setup:
    family: str
    engine: Engine
    client: anthropic.Anthropic  # the Anthropic SDK on /v1/messages
    chat: openai.OpenAI  # the same server's /v1/chat/completions, the reference
    url: str


@pytest.fixture(scope="module", params=["tiny-minimax-m2", "tiny-gpt-oss"])
def setup(request):
    engine = Engine(request.param, kv_cache_tokens=4096, max_model_len=512)
    server = ServerThread(make_app(engine, NAME))
    url = f"http://127.0.0.1:{server.port}"
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=60)
    chat = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    yield Setup(request.param, engine, client, chat, url)
    server.stop()


@pytest.fixture
def prompts(setup, monkeypatch) -> list[Any]:
    """The prompts the server hands the engine during one test."""
    engine, seen = setup.engine, []
    real = engine.stream

    def spy(prompt, params=None, request_id=None):
        seen.append(prompt)
        return real(prompt, params, request_id=request_id)

    monkeypatch.setattr(engine, "stream", spy)
    return seen


def script(engine: Engine, monkeypatch, text: str, size: int = 5) -> None:
    """The next request's output is `text`, in increments of `size` characters (the engine is not run)."""

    async def fake(prompt, params=None, request_id=None):
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            usage = (
                Usage(prompt_tokens=40, completion_tokens=len(pieces), cached_tokens=16) if last else Usage()
            )
            yield RequestOutput(request_id or "r", [i], piece, "stop" if last else None, usage)

    monkeypatch.setattr(engine, "stream", fake)


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        url + "/v1/messages", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def texts(message, kind: str) -> str:
    field = "thinking" if kind == "thinking" else "text"
    return "".join(getattr(b, field) for b in message.content if b.type == kind)


def check_events(events: list, final) -> None:
    """Anthropic's event order, and the deltas adding up to the final message's blocks (the SDK's helper
    also yields derived events: `text`, `thinking`, `input_json`; they are left out)."""
    events = [e for e in events if e.type in RAW_EVENTS]
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert events[0].message.content == [] and events[0].message.stop_reason is None
    blocks: list[dict] = []
    open_index = None
    for e in events[1:-2]:
        if e.type == "content_block_start":
            assert open_index is None and e.index == len(blocks)
            open_index = e.index
            blocks.append({"type": e.content_block.type, "text": "", "json": ""})
        elif e.type == "content_block_delta":
            assert e.index == open_index
            d = e.delta
            blocks[-1]["text"] += {
                "text_delta": getattr(d, "text", ""),
                "thinking_delta": getattr(d, "thinking", ""),
            }.get(d.type, "")
            blocks[-1]["json"] += getattr(d, "partial_json", "") if d.type == "input_json_delta" else ""
        else:
            assert e.type == "content_block_stop" and e.index == open_index
            open_index = None
    assert open_index is None and len(blocks) == len(final.content)
    for got, block in zip(blocks, final.content):
        assert got["type"] == block.type
        if block.type == "tool_use":
            assert json.loads(got["json"]) == block.input
        else:
            assert got["text"] == (block.text if block.type == "text" else block.thinking)
    assert events[-2].delta.stop_reason == final.stop_reason
    assert events[-2].usage.output_tokens == final.usage.output_tokens


# ---------------------------------------------------------------------------------------------------------
# Replies


def test_create_streamed_and_not_agree_with_chat(setup, prompts) -> None:
    engine, client, chat = setup.engine, setup.client, setup.chat
    msgs = [{"role": "user", "content": "what is the weather in the city"}]
    base = {"model": NAME, "max_tokens": 8, "system": "you help", "messages": msgs, "tools": TOOLS}
    full = client.messages.create(**base, extra_body=GREEDY)
    assert full.type == "message" and full.role == "assistant" and full.model == NAME
    assert full.stop_reason in ("end_turn", "max_tokens") and full.stop_sequence is None
    assert {b.type for b in full.content} <= {"thinking", "text"}
    assert 1 <= full.usage.output_tokens <= 8 and full.usage.cache_creation_input_tokens == 0
    # the engine got the documented chat messages: system first, tools in the function form
    chat_msgs = [{"role": "system", "content": "you help"}, *msgs]
    assert prompts[0]["messages"] == chat_msgs and prompts[0]["tools"] == CHAT_TOOLS
    length = len(render(chat_msgs, engine.tokenizer, tools=CHAT_TOOLS).token_ids)
    assert full.usage.input_tokens + full.usage.cache_read_input_tokens == length

    # the same conversation on /v1/chat/completions: the same greedy reply, split the same way
    ref = chat.chat.completions.create(
        model=NAME, messages=chat_msgs, tools=CHAT_TOOLS, max_tokens=8, temperature=0
    )
    message = ref.choices[0].message
    assert texts(full, "thinking") == ((message.model_extra or {}).get("reasoning_content") or "")
    assert texts(full, "text") == (message.content or "")
    assert full.usage.output_tokens == ref.usage.completion_tokens

    # streamed with the SDK's helper: the final message is the non-streamed one; a repeat reads the cache
    with client.messages.stream(**base, extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    check_events(events, final)
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in full.content]
    assert final.stop_reason == full.stop_reason and final.usage.output_tokens == full.usage.output_tokens
    assert final.usage.cache_read_input_tokens > 0
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == length
    # stream=True: the raw events, in the same order
    raw = list(client.messages.create(**base, stream=True, extra_body=GREEDY))
    assert [e.type for e in raw] == [e.type for e in events if e.type in RAW_EVENTS]
    check_events(raw, final)
    wait_idle(engine)


def test_stop_sequence(setup) -> None:
    engine, client = setup.engine, setup.client
    msgs = [{"role": "user", "content": "hello world"}]
    raw = engine.generate([{"messages": msgs}], SamplingParams(max_tokens=12, temperature=0))[0].text
    # a short printable piece of the greedy output, after its first character
    at = next(
        i
        for i in range(1, len(raw) - 2)
        if raw[i : i + 2].isascii() and raw[i : i + 2].strip() == raw[i : i + 2]
    )
    stop = raw[at : at + 2]
    reply = client.messages.create(
        model=NAME, max_tokens=12, messages=msgs, stop_sequences=["never there", stop], extra_body=GREEDY
    )
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert 1 <= reply.usage.output_tokens <= 12


@pytest.mark.parametrize("streamed", [False, True])
def test_tool_round_trip(setup, prompts, monkeypatch, streamed: bool) -> None:
    family, engine, client = setup.family, setup.engine, setup.client
    user = {"role": "user", "content": "what is the weather in Paris"}
    base = {"model": NAME, "max_tokens": 64, "system": "you help", "tools": TOOLS}
    spy = engine.stream
    script(engine, monkeypatch, SCRIPTS[family])
    if streamed:
        with client.messages.stream(**base, messages=[user]) as stream:
            events = list(stream)
            reply = stream.get_final_message()
        check_events(events, reply)
    else:
        reply = client.messages.create(**base, messages=[user])
    assert [b.type for b in reply.content] == ["thinking", "text", "tool_use"]
    assert reply.content[0].thinking == "Let me check." and reply.content[1].text == "Checking."
    call = reply.content[2]
    assert call.name == "get_weather" and call.input == {"city": "Paris"} and call.id
    assert reply.stop_reason == "tool_use"
    assert (reply.usage.input_tokens, reply.usage.cache_read_input_tokens) == (24, 16)
    monkeypatch.setattr(engine, "stream", spy)  # the real engine again

    result = {
        "type": "tool_result",
        "tool_use_id": call.id,
        "content": [{"type": "text", "text": "sunny today"}],
    }
    follow = [user, reply.to_param(), {"role": "user", "content": [result, {"type": "text", "text": "and?"}]}]
    answer = client.messages.create(**base, messages=follow, extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.usage.output_tokens >= 1
    assert prompts[0]["messages"] == [
        {"role": "system", "content": "you help"},
        user,
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Let me check.",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "name": "get_weather", "content": "sunny today"},
        {"role": "user", "content": "and?"},
    ]
    wait_idle(engine)


def test_real_templates_render_thinking_and_tools(setup, prompts, monkeypatch) -> None:
    """With the family's official chat template (shared test data), the converted history renders: the
    tool call and its result reach the prompt, and MiniMax-M2 keeps the reasoning of the current turn."""
    family, engine, client = setup.family, setup.engine, setup.client
    path = TEMPLATES / REAL_TEMPLATES[family]
    if not path.is_file():
        pytest.skip(f"{path} not found (shared test data)")
    monkeypatch.setattr(engine.tokenizer, "chat_template", path.read_text())
    assistant = [
        {"type": "thinking", "thinking": "call the tool", "signature": ""},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
    ]
    msgs = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": assistant},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny today"}],
        },
    ]
    reply = client.messages.create(model=NAME, max_tokens=4, messages=msgs, tools=TOOLS, extra_body=GREEDY)
    assert reply.usage.output_tokens >= 1
    text = render(prompts[0]["messages"], engine.tokenizer, tools=prompts[0]["tools"]).text
    assert "sunny today" in text and "Paris" in text and "get_weather" in text
    if family == "tiny-minimax-m2":
        assert "<think>\ncall the tool\n</think>" in text


# ---------------------------------------------------------------------------------------------------------
# Cache operations


def test_cache_drop_through_extra_body(setup, prompts) -> None:
    """Chat message ids: 0 system, 1 user, 2 assistant, 3 tool (the tool_result), 4 user (the text after
    it)."""
    family, engine, client, chat = setup.family, setup.engine, setup.client, setup.chat
    if family != "tiny-minimax-m2":
        pytest.skip("one family is enough for the numbering")
    anthropic_msgs = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Rome"}}],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "rain"},
                {"type": "text", "text": "so?"},
            ],
        },
    ]
    chat_msgs = [
        {"role": "system", "content": "you help"},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "name": "get_weather", "content": "rain"},
        {"role": "user", "content": "so?"},
    ]
    ops = {"drop": {"3": [2, 3]}, "reposition": [3]}
    reply = client.messages.create(
        model=NAME, max_tokens=5, system="you help", messages=anthropic_msgs, tools=TOOLS,
        extra_body={"cache": ops, **GREEDY},
    )  # fmt: skip
    assert prompts[0]["messages"] == chat_msgs
    assert prompts[0]["cache"] == {"drop": {3: [2, 3]}, "reposition": [3]}
    ref = chat.chat.completions.create(
        model=NAME,
        messages=chat_msgs,
        tools=CHAT_TOOLS,
        max_tokens=5,
        temperature=0,
        extra_body={"cache": ops},
    )
    assert texts(reply, "thinking") == (
        (ref.choices[0].message.model_extra or {}).get("reasoning_content") or ""
    )
    assert texts(reply, "text") == (ref.choices[0].message.content or "")
    details = ref.usage.prompt_tokens_details.model_dump()
    assert reply.usage.model_extra["drop_skipped_tokens"] == details["drop_skipped_tokens"]
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == ref.usage.prompt_tokens

    # the other spellings ride along too; a bad operation is a 400 naming its field
    client.messages.create(model=NAME, max_tokens=2, messages=anthropic_msgs, tools=TOOLS,
                           extra_body={"drop_rule": {"type": "thinking_drop"}})  # fmt: skip
    assert "message_tokens" in prompts[-1]
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            model=NAME, max_tokens=2, messages=anthropic_msgs, extra_body={"cache": {"drop": {"1": [2]}}}
        )
    assert "cache.drop" in info.value.body["error"]["message"]
    wait_idle(engine)


# ---------------------------------------------------------------------------------------------------------
# Errors


def test_bad_requests_get_anthropic_errors(setup) -> None:
    family, engine, client, url = setup.family, setup.engine, setup.client, setup.url
    if family != "tiny-minimax-m2":
        pytest.skip("the checks are the same for both families")
    user = {"role": "user", "content": "hi"}
    client.messages.create(model=NAME, max_tokens=1, messages=[user])  # one 200 for the metrics below
    status, body = post(url, {"model": NAME, "messages": [user]})  # no max_tokens
    assert status == 400 and body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == "invalid_request_error" and "max_tokens" in body["error"]["message"]

    def refused(extra: dict, words: str) -> None:
        with pytest.raises(anthropic.BadRequestError) as info:
            client.messages.create(**{"model": NAME, "max_tokens": 4, "messages": [user], **extra})
        assert info.value.status_code == 400 and info.value.body["type"] == "error"
        assert info.value.body["error"]["type"] == "invalid_request_error"
        assert words in info.value.body["error"]["message"], info.value.body

    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    refused({"messages": [{"role": "user", "content": [image]}]}, "messages[0].content[0]")
    refused({"tools": TOOLS, "tool_choice": {"type": "any"}}, "constrained decoding")
    refused({"messages": [user, {"role": "assistant", "content": "so"}]}, "prefill")
    refused({"model": "claude-nothing"}, "does not exist")
    refused({"max_tokens": 0}, "max_tokens")
    refused({"stop_sequences": [""]}, "stop_sequences")
    refused({"output_config": {"format": {"type": "json_schema", "schema": {}}}}, "output_config.format")
    with urllib.request.urlopen(url + "/metrics") as r:
        text = r.read().decode()
    for status in (200, 400):
        assert f'minakv_http_responses_total{{route="/v1/messages",status="{status}"}}' in text
    wait_idle(engine)


def test_errors_name_the_anthropic_field() -> None:
    """Chat message ids found in later errors map back to the block the client wrote."""
    req = msgspec.convert(
        {"model": "m", "max_tokens": 1, "system": "s", "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "text", "text": "b"},
                                         {"type": "tool_result", "tool_use_id": "t"}]},
        ]},
        MessagesRequest,
    )  # fmt: skip
    conv = to_chat(req)
    assert conv.origins == [
        "system",
        "messages[0]",
        "messages[1]",
        "messages[2].content[0]",
        "messages[2].content[1]",
    ]
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "user", "tool"]
    assert conv.field_name("messages[4].content") == "messages[2].content[1].content"
    assert conv.field_name("messages[9]") == "messages[9]" and conv.field_name("tools[0]") == "tools[0]"


def test_engine_failures(setup, monkeypatch) -> None:
    """A failure before the first token is a plain 500; after the stream started, an `error` event."""
    engine, client = setup.engine, setup.client
    if setup.family != "tiny-minimax-m2":
        pytest.skip("the same for both families")

    def fail_after(n: int) -> None:
        async def fake(prompt, params=None, request_id=None):
            for i in range(n):
                yield RequestOutput(request_id or "r", [i], "thinking ")
            yield RequestOutput(request_id or "r", [], "", "error")

        monkeypatch.setattr(engine, "stream", fake)

    args = {"model": NAME, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    fail_after(0)
    with pytest.raises(anthropic.InternalServerError) as info:
        client.messages.create(**args)
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "api_error"
    fail_after(2)
    events = []
    with pytest.raises(anthropic.APIStatusError) as info:
        for event in client.messages.create(**args, stream=True):
            events.append(event.type)
    assert events[:2] == ["message_start", "content_block_start"] and "message_stop" not in events
    assert info.value.body["error"]["type"] == "api_error"


def test_tool_choice_none_and_effort(setup, prompts) -> None:
    client = setup.client
    user = {"role": "user", "content": "hi"}
    client.messages.create(
        model=NAME, max_tokens=1, messages=[user], tools=TOOLS, tool_choice={"type": "none"},
        output_config={"effort": "max"},
    )  # fmt: skip
    assert "tools" not in prompts[0] and prompts[0]["chat_template_kwargs"] == {"reasoning_effort": "high"}
    client.messages.create(model=NAME, max_tokens=1, messages=[user], tools=TOOLS)
    assert prompts[1]["tools"] == CHAT_TOOLS and "chat_template_kwargs" not in prompts[1]
