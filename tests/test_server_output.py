"""What the server sends for parsed output, read back by the `openai` package's own types.

A random tiny model never writes a tool call, so the assistant text comes from the families' official chat
templates (shared test data): an assistant reply with reasoning and tool calls is rendered, the part after the generation
prompt is what the model would have produced. It is fed to the server's ChatParser in small increments;
the streamed chunks, reassembled the way a client does (tool calls by `index`), must equal the
non-streamed message, and both must give back the reply's reasoning, content and tool calls.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from openai.types.chat import ChatCompletion as OpenAIChatCompletion
from openai.types.chat import ChatCompletionChunk as OpenAIChunk

from minakv.outputs import RequestOutput, Usage
from minakv.server.output import ChatParser
from minakv.server.protocol import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChunkChoice,
    PromptTokensDetails,
    UsageInfo,
)
from minakv.text.chat import normalize_message, render_spans

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
USER = {"role": "user", "content": "weather in Paris and Rome?"}
TEMPLATES = Path(__file__).resolve().parents[2] / "shared" / "data" / "chat_templates"


def call(name: str, args: dict, cid: str) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


REPLIES = {
    "gpt_oss": (
        "gpt-oss.jinja",
        {
            "role": "assistant",
            "reasoning_content": "The user wants weather. Call the tool.",
            "tool_calls": [call("get_weather", {"city": "Paris", "days": 2}, "a")],
        },
    ),
    "minimax_m2": (
        "minimax-m2.jinja",
        {
            "role": "assistant",
            "reasoning_content": "Two cities.\nTwo calls.",
            "content": "Checking both.",
            "tool_calls": [
                call("get_weather", {"city": "Paris", "days": 2}, "a"),
                call("get_weather", {"city": "Rome"}, "b"),
            ],
        },
    ),
}


def model_output(template_name: str, reply: dict) -> str:
    """The text the model would have written for `reply`: render with and without it, keep the tail."""
    path = TEMPLATES / template_name
    if not path.is_file():
        pytest.skip(f"{path} not found (shared test data)")
    template, today = path.read_text(), {"strftime_now": lambda f: "2026-11-30"}
    history = [normalize_message(USER, 0)]
    prompt, _ = render_spans(history, template, [WEATHER], True, **today)
    full, _ = render_spans([*history, normalize_message(reply, 1)], template, [WEATHER], False, **today)
    assert full.startswith(prompt)
    return full[len(prompt) :]


def increments(text: str, size: int) -> list[RequestOutput]:
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    usage = Usage(prompt_tokens=10, completion_tokens=len(pieces))
    outs = [RequestOutput("r", [i], piece) for i, piece in enumerate(pieces)]
    outs[-1].finish_reason, outs[-1].usage = "stop", usage
    return outs


USAGE = UsageInfo(10, 5, 15, PromptTokensDetails())


@pytest.mark.parametrize("arch", sorted(REPLIES))
@pytest.mark.parametrize("size", [1, 7])
def test_streamed_and_whole_messages_read_back_by_openai(arch: str, size: int) -> None:
    template, reply = REPLIES[arch]
    text = model_output(template, reply)

    whole = ChatParser(arch, None, [WEATHER])
    for out in increments(text, size):
        whole.step(out)
    message, finish = whole.message("stop")
    body = msgspec.json.encode(ChatCompletion("c", 0, "m", [ChatChoice(0, message, finish)], USAGE))
    got = OpenAIChatCompletion.model_validate_json(body).choices[0]
    assert got.finish_reason == "tool_calls"
    assert got.message.content == reply.get("content")
    assert got.message.model_extra["reasoning_content"] == reply["reasoning_content"]
    want = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply["tool_calls"]]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got.message.tool_calls] == want
    assert len({c.id for c in got.message.tool_calls}) == len(want)

    # streamed: chunks as the server writes them, reassembled like a client
    stream = ChatParser(arch, None, [WEATHER])
    content, reasoning, calls = "", "", {}
    for out in increments(text, size):
        for delta, lps in stream.deltas(out):
            raw = msgspec.json.encode(ChatCompletionChunk("c", 0, "m", [ChunkChoice(0, delta, None, lps)]))
            d = OpenAIChunk.model_validate_json(raw).choices[0].delta
            content += d.content or ""
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            for tc in d.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": ""})
                entry["arguments"] += tc.function.arguments or ""
    assert stream.finish_reason("stop") == "tool_calls"
    assert content == (got.message.content or "") and reasoning == reply["reasoning_content"]
    streamed = [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]
    assert streamed == want
    ids = [calls[i]["id"] for i in sorted(calls)]
    assert all(ids) and len(set(ids)) == len(ids)  # the first delta of each call carries its id
