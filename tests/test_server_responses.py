"""`POST /v1/responses` against real clients over a socket, on both tiny presets: the `openai` package
(`responses.create`, streamed and not, and its stream manager, which checks that the events build the
final response; it needs `response.completed`, so it runs on the scripted call below), raw SSE checked event by event against `openai.types.responses`, and an `openai-agents`
loop.

Greedy outputs are compared with `Engine.generate` on the chat conversation the input items stand for,
so the item -> message conversion (and its numbering, which cache operations use) is checked by the
tokens it renders to. A random model never calls a tool, so the function-call round trip scripts the
model's text (the families' official templates' rendering of a call, shared test data) for one request.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
from helpers.server import ServerThread, hand_thinking_drop, wait_idle
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from minakv.engine import Engine
from minakv.outputs import RequestOutput, Usage
from minakv.params import SamplingParams
from minakv.server.app import make_app
from minakv.text.chat import normalize_message, render, render_spans
from minakv.text.parsers import parse_output

TEMPLATES = Path(__file__).resolve().parents[2] / "shared" / "data" / "chat_templates"
FAMILIES = {"tiny-gpt-oss": "gpt-oss.jinja", "tiny-minimax-m2": "minimax-m2.jinja"}
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city.",
    "parameters": PARAMS,
}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
EVENTS = TypeAdapter(ResponseStreamEvent)
# input items and the chat messages they stand for: with instructions, message 0 is the system message,
# the reasoning and the call are ONE assistant message (2), the call's output is message 3
ITEMS = [
    {"role": "user", "content": "what is the weather in Paris"},
    {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "use the tool"}]},
    {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
     "arguments": '{"city": "Paris"}', "status": "completed"},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny today"},
]  # fmt: skip
MESSAGES = [
    {"role": "system", "content": "You help."},
    {"role": "user", "content": "what is the weather in Paris"},
    {"role": "assistant", "content": None, "reasoning_content": "use the tool", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny today"},
]  # fmt: skip


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request):
    engine = Engine(request.param, kv_cache_tokens=4096, max_model_len=512)
    server = ServerThread(make_app(engine))
    url = f"http://127.0.0.1:{server.port}/v1"
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
    yield SimpleNamespace(engine=engine, client=client, url=url, model=request.param)
    server.stop()


def texts(output: list) -> tuple[str, str, list[tuple[str, str]]]:
    """(reasoning, message text, [(name, arguments)]) of output items (dicts or openai objects)."""
    items = [i if isinstance(i, dict) else i.model_dump() for i in output]
    reasoning = "".join(c["text"] for i in items if i["type"] == "reasoning" for c in i["content"])
    content = "".join(c["text"] for i in items if i["type"] == "message" for c in i["content"])
    return reasoning, content, [(i["name"], i["arguments"]) for i in items if i["type"] == "function_call"]


def reference(engine: Engine, prompt: dict, max_tokens: int):
    """The engine's greedy run of the chat prompt, parsed as the server parses it."""
    ref = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0))[0]
    parsed = parse_output(ref.text, engine.arch, prompt.get("tools"))
    calls = [(c.name, c.arguments) for c in parsed.tool_calls]
    return ref, (parsed.reasoning_content or "", parsed.content or "", calls)


def sse(url: str, body: dict) -> list[dict]:
    """A streamed request read as raw server-sent events; each checked against openai's event types."""
    req = urllib.request.Request(
        url + "/responses",
        json.dumps({**body, "stream": True}).encode(),
        {"Content-Type": "application/json"},
    )
    events, kind = [], None
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp.read().decode().split("\n"):
            if line.startswith("event: "):
                kind = line[len("event: ") :]
            elif line.startswith("data: "):
                event = json.loads(line[len("data: ") :])
                assert event["type"] == kind
                EVENTS.validate_python(event, strict=False)
                events.append(event)
    return events


TEXT_EVENTS = {
    "reasoning": "reasoning_text",
    "message": "output_text",
    "function_call": "function_call_arguments",
}


def check_events(events: list[dict]) -> dict:
    """The event grammar (module docstring of responses_output.py); returns the final response, whose
    items the deltas must have built."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    final, body = events[-1], events[2:-1]
    assert final["type"] in ("response.completed", "response.incomplete")
    assert final["response"]["status"] == final["type"].removeprefix("response.")
    at = 0
    for index, item in enumerate(final["response"]["output"]):
        mine = []
        while at < len(body) and body[at].get("output_index") == index:
            mine.append(body[at])
            at += 1
        text = TEXT_EVENTS[item["type"]]
        part = [] if item["type"] == "function_call" else ["content_part"]
        deltas = [e["delta"] for e in mine if e["type"].endswith(".delta")]
        assert [e["type"].removeprefix("response.") for e in mine] == [
            "output_item.added", *(f"{p}.added" for p in part), *[f"{text}.delta"] * len(deltas),
            f"{text}.done", *(f"{p}.done" for p in part), "output_item.done",
        ]  # fmt: skip
        assert mine[0]["item"]["id"] == item["id"] and mine[-1]["item"] == item
        whole = item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"]
        assert "".join(deltas) == whole
    assert at == len(body)
    return final["response"]


def request_body(model: str, **extra) -> dict:
    return {"model": model, "instructions": "You help.", "input": ITEMS, "tools": [WEATHER],
            "max_output_tokens": 6, "temperature": 0, **extra}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------


def test_non_streamed_equals_generate(served) -> None:
    body = request_body(served.model, reasoning={"effort": "low"})
    raw = served.client.responses.with_raw_response.create(**body)
    resp = Response.model_validate_json(raw.text)  # every field as openai's types say
    prompt = {
        "messages": MESSAGES,
        "tools": [CHAT_WEATHER],
        "chat_template_kwargs": {"reasoning_effort": "low"},
    }
    ref, want = reference(served.engine, prompt, 6)
    assert texts(resp.output) == want
    rendered = render(MESSAGES, served.engine.tokenizer, tools=[CHAT_WEATHER], reasoning_effort="low")
    assert resp.usage.input_tokens == ref.usage.prompt_tokens == len(rendered.token_ids)
    assert resp.usage.output_tokens == len(ref.token_ids)
    assert resp.status == ("incomplete" if ref.finish_reason == "length" else "completed")
    assert resp.object == "response" and resp.model == served.model and resp.id.startswith("resp_")
    assert resp.tools[0].name == "get_weather" and resp.instructions == "You help."
    assert 0 <= resp.usage.output_tokens_details.reasoning_tokens <= resp.usage.output_tokens
    # a plain string input is one user message
    short = served.client.responses.create(
        model=served.model, input="hello", max_output_tokens=3, temperature=0
    )
    _, want = reference(served.engine, {"messages": [{"role": "user", "content": "hello"}]}, 3)
    assert texts(short.output) == want and short.usage.output_tokens <= 3


def test_streamed_events_build_the_response(served) -> None:
    body = request_body(served.model)
    whole = served.client.responses.create(**body)
    final = check_events(sse(served.url, body))
    assert texts(final["output"]) == texts(whole.output)
    assert final["usage"]["output_tokens"] == whole.usage.output_tokens
    # the openai client: typed events, and its stream manager, which rebuilds the response from them
    events = list(served.client.responses.create(**body, stream=True))
    assert events[0].type == "response.created" and events[-1].type == f"response.{whole.status}"
    deltas = "".join(
        e.delta for e in events if e.type in ("response.output_text.delta", "response.reasoning_text.delta")
    )
    assert deltas == "".join(texts(whole.output)[:2])


def test_cache_drop_rides_along(served) -> None:
    """The numbering: message 3 is the call's output (instructions = 0, the reasoning and the call = 2)."""
    ops = {"drop": {"3": [2, 3]}, "reposition": [3]}
    prompt = {"messages": MESSAGES, "tools": [CHAT_WEATHER], "cache": ops}
    _, want = reference(served.engine, prompt, 6)
    for extra in ({"cache": ops}, {"drop_message": ops["drop"], "reposition": ops["reposition"]}):
        resp = served.client.responses.create(**request_body(served.model), extra_body=extra)
        assert texts(resp.output) == want
        again = served.engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0))[0].usage
        details = resp.usage.input_tokens_details.model_dump()
        assert (resp.usage.input_tokens, details["cached_tokens"], details["repos_tokens"]) == (
            again.prompt_tokens, again.cached_tokens, again.repos_tokens)  # fmt: skip
        assert details["drop_skipped_tokens"] == again.drop_skipped_tokens
    streamed = check_events(sse(served.url, request_body(served.model, cache=ops)))
    assert texts(streamed["output"]) == want
    # thinking_drop: the reasoning item's text leaves the cache at the end of its assistant message
    prompt, length = hand_thinking_drop(served.engine.tokenizer, MESSAGES, 2, "use the tool", [CHAT_WEATHER])
    _, want = reference(served.engine, prompt, 6)
    body = request_body(served.model)
    resp = served.client.responses.create(**body, extra_body={"drop_rule": {"type": "thinking_drop"}})
    assert texts(resp.output) == want and resp.usage.input_tokens == length
    # a drop past the last message is a future event; a drop after its trigger names the field
    with pytest.raises(openai.BadRequestError) as info:
        served.client.responses.create(
            **request_body(served.model), extra_body={"cache": {"drop": {"1": [2]}}}
        )
    assert info.value.body["param"] == "cache.drop"
    wait_idle(served.engine)


def test_item_numbering_as_documented() -> None:
    """docs/server.md's example: the chat message each input item becomes (cache operations name these)."""
    from minakv.server.responses import ResponsesRequest, to_messages

    def call(c):
        return {"type": "function_call", "call_id": c, "name": "get_weather", "arguments": "{}"}

    def thought(text):
        return {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}

    items = [
        {"role": "user", "content": "weather in Paris and Rome?"}, thought("two calls"), call("c1"), call("c2"),
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "rain"}, thought("done"),
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny, rain."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "and tomorrow?"}]},
    ]  # fmt: skip
    conv = to_messages(ResponsesRequest(model="m", input=items, instructions="You help."))
    assert [m["role"] for m in conv.messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
        "user",
    ]
    assert conv.origins == ["instructions", *(f"input[{j}]" for j in (0, 1, 4, 5, 6, 8))]
    assert [c["id"] for c in conv.messages[2]["tool_calls"]] == ["c1", "c2"]
    assert conv.messages[2]["reasoning_content"] == "two calls" and conv.messages[2]["content"] is None
    assert (conv.messages[5]["reasoning_content"], conv.messages[5]["content"]) == ("done", "Sunny, rain.")
    # the order within a turn is reasoning, text, calls: going back starts a new assistant message
    again = to_messages(
        ResponsesRequest(model="m", input=[items[0], call("c1"), thought("more"), call("c2")])
    )
    assert [m["role"] for m in again.messages] == ["user", "assistant", "assistant"]


def test_refusals_name_the_field(served) -> None:
    c, model = served.client, served.model
    cases = [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [ITEMS[0], {"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[1]"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": "required", "tools": [WEATHER]}, "tool_choice"),
        ({"reasoning": {"effort": "huge"}}, "reasoning.effort"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ]  # fmt: skip
    for extra, param in cases:
        body = {"model": model, "input": "hi", **extra}
        with pytest.raises(openai.BadRequestError) as info:
            c.responses.create(**body)
        got = info.value.body
        assert got["type"] == "invalid_request_error" and (got["param"] or "").startswith(param), (extra, got)
    # store is accepted; nothing is kept
    resp = c.responses.create(model=model, input="hi", max_output_tokens=1, store=True)
    assert resp.status in ("completed", "incomplete")


# ---------------------------------------------------------------------------------------------------------
# A scripted function call, with the official templates


def model_output(template: str, reply: dict) -> str:
    """The text the model writes for `reply`: the template's rendering after the generation prompt."""
    history = [normalize_message(ITEMS[0], 0)]
    prompt, _ = render_spans(history, template, [CHAT_WEATHER], True)
    full, _ = render_spans([*history, normalize_message(reply, 1)], template, [CHAT_WEATHER], False)
    assert full.startswith(prompt)
    return full[len(prompt) :]


def scripted(text: str, prompt_tokens: int = 10):
    """An `engine.stream` replacement that writes `text` in small increments."""

    async def stream(prompt, params=None, request_id=None):
        pieces = [text[i : i + 5] for i in range(0, len(text), 5)]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            yield RequestOutput(request_id, [i], piece, "stop" if last else None,
                                Usage(prompt_tokens=prompt_tokens, completion_tokens=len(pieces)))  # fmt: skip

    return stream


def test_function_call_and_its_output(served, monkeypatch) -> None:
    path = TEMPLATES / FAMILIES[served.model]
    if not path.is_file():
        pytest.skip(f"{path} not found (shared test data)")
    engine = served.engine
    monkeypatch.setattr(engine.tokenizer, "chat_template", path.read_text())
    call = {
        "id": "x",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    reply = {"role": "assistant", "reasoning_content": "Use the tool.", "tool_calls": [call]}
    text = model_output(engine.tokenizer.chat_template, reply)
    body = {"model": served.model, "input": [ITEMS[0]], "tools": [WEATHER]}

    with monkeypatch.context() as m:
        m.setattr(engine, "stream", scripted(text))
        first = served.client.responses.create(**body)
        events = list(served.client.responses.create(**body, stream=True))
        with served.client.responses.stream(**body) as stream:  # rebuilds the response from the events
            rebuilt = stream.get_final_response()
    assert first.status == "completed" and texts(rebuilt.output) == texts(first.output)
    assert texts(first.output) == ("Use the tool.", "", [("get_weather", '{"city": "Paris"}')])
    kinds = [e.type for e in events]
    assert (
        "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    )
    assert texts(events[-1].response.output) == texts(first.output)
    fc = first.output[-1]
    assert fc.type == "function_call" and fc.call_id and fc.id.startswith("fc_")

    # the second round sends the output items back with the call's result: the same tokens as the chat
    # conversation it stands for, with the official template
    items = [ITEMS[0], *(i.model_dump(exclude_none=True) for i in first.output)]
    items.append({"type": "function_call_output", "call_id": fc.call_id, "output": "sunny today"})
    second = served.client.responses.create(model=served.model, input=items, tools=[WEATHER],
                                            max_output_tokens=3, temperature=0)  # fmt: skip
    chat_call = {**call, "id": fc.call_id}
    messages = [ITEMS[0], {"role": "assistant", "content": None, "reasoning_content": "Use the tool.",
                           "tool_calls": [chat_call]},
                {"role": "tool", "tool_call_id": fc.call_id, "content": "sunny today"}]  # fmt: skip
    ref, want = reference(engine, {"messages": messages, "tools": [CHAT_WEATHER]}, 3)
    assert second.usage.input_tokens == ref.usage.prompt_tokens
    assert texts(second.output) == want
    wait_idle(engine)


def test_engine_failure_after_the_stream_started(served, monkeypatch) -> None:
    """A failure after the first increment: the stream ends with response.failed, a whole response is a 500."""

    async def failing(prompt, params=None, request_id=None):
        yield RequestOutput(
            request_id, [1], "<|channel|>final<|message|>Hel" if "gpt" in served.model else "x"
        )
        yield RequestOutput(request_id, [], "", "error")

    monkeypatch.setattr(served.engine, "stream", failing)
    events = list(served.client.responses.create(model=served.model, input="hi", stream=True))
    assert events[-1].type == "response.failed" and events[-1].response.status == "failed"
    assert events[-1].response.error.code == "server_error"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    with pytest.raises(openai.InternalServerError):
        served.client.responses.create(model=served.model, input="hi")


# ---------------------------------------------------------------------------------------------------------
# openai-agents

# What a model of each family writes to call get_weather, and to answer (parsed by the family's parser)
HARMONY_CALL = "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>"
MINIMAX_CALL = (
    '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n</invoke>'
)
SCRIPTS = {
    "tiny-gpt-oss": (
        "<|channel|>analysis<|message|>Use the tool.<|end|>" + HARMONY_CALL + '{"city": "Paris"}',
        "<|channel|>final<|message|>It is sunny.",
    ),
    "tiny-minimax-m2": (
        "Use the tool.</think>\n\n" + MINIMAX_CALL + "\n</minimax:tool_call>",
        "Answer.</think>\n\nIt is sunny.",
    ),
}


def agent_loop(served, model_settings, first_input: str):
    """Two runs of an Agent with one function tool: Runner.run, then Runner.run_streamed on the first run's
    history plus a new user message. Returns (first result, second result, the tool's calls)."""
    import agents
    from agents import Agent, OpenAIResponsesModel, RunConfig, Runner, function_tool

    agents.set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """Weather of a city."""
        calls.append(city)
        return "sunny"

    async def main():
        client = openai.AsyncOpenAI(base_url=served.url, api_key="none", max_retries=0, timeout=120)
        try:
            agent = Agent(name="helper", instructions="You help.", tools=[get_weather],
                          model=OpenAIResponsesModel(served.model, client), model_settings=model_settings)  # fmt: skip
            config = RunConfig(tracing_disabled=True)
            first = await Runner.run(agent, first_input, max_turns=4, run_config=config)
            turn = first.to_input_list() + [{"role": "user", "content": "and in Rome"}]
            second = Runner.run_streamed(agent, turn, max_turns=4, run_config=config)
            async for _ in second.stream_events():
                pass
            return first, second
        finally:
            await client.close()

    first, second = asyncio.run(main())
    return first, second, calls


def test_agents_sdk_tool_loop(served, monkeypatch) -> None:
    """The model's text is scripted (a call, then an answer once the conversation holds the tool's
    output), so the loop is deterministic: model -> tool -> model, twice. The scripted stream renders
    every prompt it gets with the chat template, so the items the SDK sends back must convert."""
    pytest.importorskip("agents")
    from agents import ModelSettings

    engine, (call, answer) = served.engine, SCRIPTS[served.model]
    seen = []

    def stream(prompt, params=None, request_id=None):
        seen.append(prompt)
        done = prompt["messages"][-1]["role"] == "tool"
        rendered = render(prompt["messages"], engine.tokenizer, tools=prompt.get("tools"))
        return scripted(answer if done else call, len(rendered.token_ids))(prompt, params, request_id)

    monkeypatch.setattr(engine, "stream", stream)
    first, second, calls = agent_loop(served, ModelSettings(temperature=0), "what is the weather in Paris")
    assert calls == ["Paris", "Paris"]  # the scripted model calls the tool once per run
    assert first.final_output == second.final_output == "It is sunny."
    assert len(first.raw_responses) == len(second.raw_responses) == 2
    kinds = [[i.type for i in r.output] for r in first.raw_responses]
    assert kinds[0][-1] == "function_call" and kinds[1][-1] == "message"
    roles = [[m["role"] for m in p["messages"]] for p in seen]
    assert roles[:2] == [["system", "user"], ["system", "user", "assistant", "tool"]]
    # the second run resends the whole first run: its calls, outputs and answer, then the new question
    assert roles[2] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert seen[2]["messages"][2]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_agents_sdk_random_model(served) -> None:
    """The real model, random weights: every token is made a stop token, so each turn ends after one token
    as `completed` (an output cut at max_output_tokens is `incomplete`, which the SDK raises on). The text
    is whatever it is; the loop must run and every response must be well formed."""
    pytest.importorskip("agents")
    from agents import ModelSettings

    stops = {"stop_token_ids": list(range(served.engine.tokenizer.vocab_size))}
    settings = ModelSettings(temperature=0, max_tokens=8, extra_body=stops)
    first, second, _ = agent_loop(served, settings, "what is the weather in Paris")
    for result in (first, second):
        assert result.raw_responses and isinstance(result.final_output, str)
        for response in result.raw_responses:
            assert response.usage.requests == 1 and response.usage.output_tokens == 1
    wait_idle(served.engine)
