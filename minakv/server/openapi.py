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
            "text/event-stream": {"schema": {"type": "string"}},
        },
    }
    return {"post": {"requestBody": {"required": True, **json_body(ref(request))},
                     "responses": answers(ok, 400, 401, 404, 413, 500, 503)}}  # fmt: skip


def constrain(components: dict[str, Any], names: tuple[str, ...], limits: Limits, max_model_len: int) -> None:
    """The app's own values in the request schemas: the checks in limits.py and prompts.py use the same."""
    for request in ("ChatCompletionRequest", "CompletionRequest"):
        props = components[request]["properties"]
        props["model"]["enum"] = list(names)
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props:
                props[field]["anyOf"][0].update(minimum=1, maximum=max_model_len - 1)
        stop = props["stop"]["anyOf"]
        stop[0]["maxLength"] = limits.max_stop_chars
        stop[1].update(maxItems=limits.max_stop)
        stop[1]["items"]["maxLength"] = limits.max_stop_chars
        props["stop_token_ids"]["anyOf"][0]["maxItems"] = limits.max_stop_token_ids
    chat = components["ChatCompletionRequest"]["properties"]
    chat["messages"].update(minItems=1, maxItems=limits.max_messages)
    chat["tools"]["anyOf"][0]["maxItems"] = limits.max_tools
    chat["top_logprobs"]["anyOf"][0].update(minimum=0, maximum=20)
    components["CompletionRequest"]["properties"]["logprobs"]["anyOf"][0].update(minimum=0, maximum=20)


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
