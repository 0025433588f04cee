"""`GET /openapi.json`: an OpenAPI 3.1 description of the OpenAI-compatible routes.

The schemas are generated from the msgspec types in protocol.py, the very types that decode requests and
encode responses, so the description cannot drift from what the server accepts and sends. What the types
do not say is filled in from the app's own settings, the same values the checks use: the model names a
request may send, the limits (limits.py) and max_model_len. Every status a route can answer is listed with
its body (errors: the OpenAI error shape), so a schema-driven fuzzer (tests/test_server_fuzz.py) can check
both the requests the server takes and every answer it gives.

The Responses and Anthropic Messages routes are not described here yet.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec

from minakv.server.limits import Limits
from minakv.server.protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorBody,
    ModelCard,
    ModelList,
)

TYPES = (ChatCompletionRequest, CompletionRequest, ChatCompletion, ChatCompletionChunk, Completion, ModelList,
         ModelCard, ErrorBody)  # fmt: skip
ERRORS = {
    400: "the request is invalid (the error's `param` names the field)",
    401: "missing or wrong API key",
    404: "no such model",
    413: "request body too large",
    500: "the engine failed while running the request",
    503: "the waiting queue is full, or the server is shutting down",
}


# one Server-Sent Event: `data` is a chunk as JSON (`response` below), an error object, or `[DONE]`
SSE_EVENT = {
    "type": "object",
    "properties": {
        "data": {"type": "string", "contentMediaType": "application/json"},
        "event": {"type": "string"},
    },
    "required": ["data"],
}


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def json_body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


def answers(ok: dict[str, Any], *errors: int) -> dict[str, Any]:
    out = {"200": ok}
    out.update({str(s): {"description": ERRORS[s], **json_body(ref("ErrorBody"))} for s in errors})
    return out


def generation(request: str, response: str, what: str) -> dict[str, Any]:
    """A POST route that generates: JSON, or Server-Sent Events of `response` chunks with `stream`."""
    ok = {
        "description": f"the {what}; with `stream`, Server-Sent Events (`data: <chunk>`, then `data: [DONE]`)",
        "content": {
            "application/json": {"schema": ref(response)},
            "text/event-stream": {"schema": SSE_EVENT},
        },
    }
    return {"post": {"requestBody": {"required": True, **json_body(ref(request))},
                     "responses": answers(ok, 400, 401, 404, 413, 500, 503)}}  # fmt: skip


# What the checks accept beyond the types (prompts.py, SamplingParams.check, the renderer): said here for
# clients, and so that a fuzzer's well-formed requests reach generation instead of stopping at a 400.
ACCEPTED = {
    "temperature": {"minimum": 0, "maximum": 100},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": -1},  # 0 and -1: no limit
    "min_p": {"minimum": 0, "maximum": 1},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "repetition_penalty": {"exclusiveMinimum": 0, "maximum": 10},
    "seed": {"minimum": 0, "maximum": 2**63 - 1},
    "n": {"minimum": 1, "maximum": 16},  # prompts.MAX_CHOICES
    "logit_bias": {"maxProperties": 1024, "propertyNames": {"pattern": "^[0-9]+$"},
                   "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
    "reasoning_effort": {"enum": ["low", "medium", "high"]},
    "chat_template_kwargs": {"additionalProperties": False, "properties": {  # prompts.TEMPLATE_VARIABLES
        "reasoning_effort": {"enum": ["low", "medium", "high"]}, "model_identity": {"type": "string"},
        "builtin_tools": {"type": "array", "items": {"enum": ["browser", "python"]}},
        "enable_thinking": {"type": "boolean"}}},
    "best_of": {"const": 1},
    "echo": {"const": False},
    "suffix": {"maxLength": 0},
}  # fmt: skip


def narrow(schema: dict[str, Any], **rules: Any) -> None:
    """Add `rules` to a field's schema: to its non-null branch if it is nullable (`anyOf [X, null]`)."""
    branches = [b for b in schema.get("anyOf", []) if b.get("type") != "null"]
    (branches[0] if len(branches) == 1 else schema).update(rules)


def constrain(components: dict[str, Any], names: tuple[str, ...], limits: Limits, max_model_len: int) -> None:
    """The app's own values (model names, limits, max_model_len: the checks in limits.py and prompts.py use
    the same) and ACCEPTED in the request schemas."""
    for request in ("ChatCompletionRequest", "CompletionRequest"):
        props = components[request]["properties"]
        props["model"]["enum"] = list(names)
        for field, rules in ACCEPTED.items():
            if field in props:
                narrow(props[field], **rules)
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props:
                narrow(props[field], minimum=1, maximum=max_model_len - 1)
        one, many = props["stop"]["anyOf"][:2]
        one.update(minLength=1, maxLength=limits.max_stop_chars)
        many.update(
            maxItems=limits.max_stop,
            items={"type": "string", "minLength": 1, "maxLength": limits.max_stop_chars},
        )
        narrow(
            props["stop_token_ids"],
            maxItems=limits.max_stop_token_ids,
            items={"type": "integer", "minimum": 0},
        )
    chat = components["ChatCompletionRequest"]["properties"]
    chat["messages"].update(minItems=1, maxItems=limits.max_messages)
    narrow(chat["tools"], maxItems=limits.max_tools)
    narrow(chat["top_logprobs"], minimum=0, maximum=20)
    part = components["ContentPart"]
    part["properties"]["type"] = {"const": "text"}  # text parts only
    part["properties"]["text"] = {"type": "string"}
    part["required"] = ["type", "text"]
    completion = components["CompletionRequest"]["properties"]
    narrow(completion["logprobs"], minimum=0, maximum=20)
    completion["prompt"] = {"anyOf": [{"type": "string", "minLength": 1},
                                      {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}]}  # fmt: skip


@functools.lru_cache(maxsize=8)
def openapi_document(names: tuple[str, ...], limits: Limits, max_model_len: int, api_key: bool) -> bytes:
    """The description as JSON for an app serving `names`, with its `limits` and `max_model_len`;
    `api_key`: the /v1 routes need a bearer key."""
    _, components = msgspec.json.schema_components(TYPES, ref_template="#/components/schemas/{name}")
    constrain(components, names, limits, max_model_len)
    model_param = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
    paths: dict[str, Any] = {
        "/v1/chat/completions": generation("ChatCompletionRequest", "ChatCompletion", "chat completion"),
        "/v1/completions": generation("CompletionRequest", "Completion", "completion"),
        "/v1/models": {"get": {"responses": answers({"description": "the served models", **json_body(ref("ModelList"))}, 401, 503)}},
        "/v1/models/{model}": {"get": {"parameters": [model_param], "responses": answers(
            {"description": "one served model", **json_body(ref("ModelCard"))}, 401, 404, 503)}},
        "/health": {"get": {"responses": answers({"description": "the server is up", **json_body(
            {"type": "object", "properties": {"status": {"const": "ok"}}, "required": ["status"]})}, 503)}},
        "/metrics": {"get": {"responses": {"200": {"description": "Prometheus text format",
                                                   "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        "/openapi.json": {"get": {"responses": answers({"description": "this document", **json_body({"type": "object"})}, 503)}},
    }  # fmt: skip
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "minakv",
            "version": "1",
            "description": "OpenAI-compatible server (docs/server.md)",
        },
        "paths": paths,
        "components": {"schemas": components},
    }
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in paths.items():
            if path.startswith("/v1/"):
                for operation in item.values():
                    operation["security"] = [{"bearer": []}]
    return msgspec.json.encode(doc)
