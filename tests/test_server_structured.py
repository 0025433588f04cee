"""Structured outputs over /v1/chat/completions with the `openai` client, on both tiny presets: random weights
always give JSON valid under `response_format`'s schema, and `tool_choice` "required" (or a named function)
always gives a well-formed call of a listed function with valid arguments. Only a grammar can make random
weights do that. Bad fields are 400s naming them."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from helpers.server import ServerThread, wait_idle

from minakv.engine import Engine
from minakv.server.app import make_app

NAME = "structured-test"
SHORT = {"type": "string", "maxLength": 8}
PERSON = {
    "type": "object",
    "properties": {
        "name": SHORT,
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
        "pets": {"type": "array", "maxItems": 2,
                 "items": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "name": SHORT},
                           "required": ["kind"], "additionalProperties": False}},
    },
    "required": ["name", "age", "role", "pets"],
    "additionalProperties": False,
}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": {
        "type": "object",
        "properties": {"city": SHORT, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                       "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Tell me about a person, or call a tool."}]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module", params=["tiny-gpt-oss", "tiny-minimax-m2"])
def setup(request):
    engine = Engine(request.param, max_model_len=1024, kv_cache_tokens=8192)
    server = ServerThread(make_app(engine, NAME))
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0, timeout=120
    )
    yield engine, client
    server.stop()


def create(client: openai.OpenAI, **fields):
    return client.chat.completions.create(model=NAME, messages=ASK, max_tokens=256, **fields)


def test_json_schema_answers_are_valid(setup) -> None:
    engine, client = setup
    for seed in range(8):
        resp = create(client, seed=seed, response_format=RESPONSE_FORMAT)
        choice = resp.choices[0]
        assert choice.finish_reason == "stop" and not choice.message.tool_calls, choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    wait_idle(engine)


def test_json_schema_streamed(setup) -> None:
    _, client = setup
    chunks = list(create(client, seed=3, response_format=RESPONSE_FORMAT, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(content), PERSON)
    assert content == create(client, seed=3, response_format=RESPONSE_FORMAT).choices[0].message.content


def test_json_object_is_an_object(setup) -> None:
    """Nothing bounds "any object", so the tokens closing strings, objects and arrays get a large logit bias
    (the grammar still decides which are allowed): a random model would write one string forever."""
    engine, client = setup
    bias = dict(zip(map(engine.tokenizer.token_to_id, ('"', "}", "]")), (100, 90, 80)))
    for seed in range(3):
        resp = create(client, seed=seed, response_format={"type": "json_object"},
                      logit_bias={str(t): b for t, b in bias.items()})  # fmt: skip
        assert resp.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(resp.choices[0].message.content), dict)


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_are_well_formed(setup, choice: str) -> None:
    engine, client = setup
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "add"}}
    names = set()
    for seed in range(6):
        resp = create(client, seed=seed, tools=TOOLS, tool_choice=tool_choice)
        message = resp.choices[0].message
        assert resp.choices[0].finish_reason == "tool_calls" and message.tool_calls and not message.content
        for call in message.tool_calls:
            assert call.type == "function" and call.id
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            names.add(call.function.name)
    assert names <= set(SCHEMAS) and (choice == "required" or names == {"add"})
    wait_idle(engine)


def test_forced_tool_call_streamed(setup) -> None:
    _, client = setup
    chunks = list(create(client, seed=1, tools=TOOLS, tool_choice="required", stream=True))
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            call = calls.setdefault(d.index, {"name": "", "arguments": ""})
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and calls
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_auto_with_response_format_answers_or_calls(setup) -> None:
    _, client = setup
    for seed in range(4):
        message = create(client, seed=seed, tools=TOOLS, response_format=RESPONSE_FORMAT).choices[0].message
        if message.tool_calls:
            for call in message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        else:
            jsonschema.validate(json.loads(message.content), PERSON)


@pytest.mark.parametrize(
    "fields,param,words",
    [
        ({"response_format": {"type": "yaml"}}, "response_format.type", "'json_schema'"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "'name'"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no"}}}},
         "response_format", "no"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name", "not among the tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function.name", "'name'"),
    ],
)  # fmt: skip
def test_bad_fields_are_400(setup, fields: dict, param: str, words: str) -> None:
    _, client = setup
    with pytest.raises(openai.BadRequestError) as err:
        create(client, **fields)
    body = err.value.body
    assert body["param"] == param and words in body["message"], body
