"""Structured outputs on /v1/chat/completions: `response_format` and `tool_choice` -> the request's grammar.

    response_format {"type": "json_object"}                   the answer is a JSON object
    response_format {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}
                                                              the answer is valid under the schema (strict
                                                              or not: the grammar always enforces it)
    tool_choice "required"                                    the turn calls one of the tools
    tool_choice {"type": "function", "function": {"name": N}} the turn calls N
    tools on "auto" plus a response_format                    either: a call, or the answer

The grammar spells the model family's chat markup around the JSON (minakv/grammar/formats.py), so the reply
is parsed as any other: the answer becomes `content`, a call `tool_calls` (finish reason "tool_calls"). A
forced call wins over a response_format: the turn has no answer to shape. A constrained turn has no
reasoning (formats.py says why).

The grammar is compiled in a worker thread before the request reaches the engine: the engine compiles it
again when the request is made, on the event loop, and finds it in the compiler's cache. The first grammar
of a tokenizer also builds llguidance's view of the vocabulary (seconds for GPT-OSS's 201,088 tokens).
"""

from __future__ import annotations

from typing import Any

from minakv.grammar import chat_output, compile_grammar
from minakv.params import Grammar
from minakv.prompt import stop_token_ids
from minakv.server.prepare import in_thread
from minakv.server.protocol import ChatCompletionRequest, RequestError


def answer_schema(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """The JSON schema the answer must match, or None (plain text)."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise RequestError(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r:.100}",
            "response_format.type",
        )
    spec = response_format.get("json_schema")  # type: ignore[union-attr]
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise RequestError(
            "response_format.json_schema must be an object with a 'name' and a 'schema'",
            "response_format.json_schema",
        )
    schema = spec.get("schema", {})  # no schema: any JSON value
    if not isinstance(schema, dict):
        raise RequestError(
            "response_format.json_schema.schema must be an object", "response_format.json_schema.schema"
        )
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise RequestError(
            "response_format.json_schema.strict must be a boolean", "response_format.json_schema.strict"
        )
    return schema


def forced_tools(
    choice: str | dict[str, Any] | None, tools: list[dict[str, Any]]
) -> list[dict[str, Any]] | None:
    """The tools the turn must call one of (`tools` as sent), or None when no call is forced."""
    if choice == "required":
        return tools
    if not isinstance(choice, dict):
        return None
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise RequestError(
            "a named tool_choice is {'type': 'function', 'function': {'name': ...}}",
            "tool_choice.function.name",
        )
    named = [t for t in tools if t.get("function", {}).get("name") == name]
    if not named:
        raise RequestError(
            f"tool_choice names {name!r:.100}, which is not among the tools", "tool_choice.function.name"
        )
    return named


def chat_grammar(
    req: ChatCompletionRequest, raw: dict[str, Any], tools_on: bool, arch: str, tokenizer: Any
) -> Grammar | None:
    """The request's grammar, or None when nothing constrains the output. `raw`: the body as plain JSON
    (tools as sent), `tools_on`: whether the tools are rendered (prompts.tool_choice_mode)."""
    answer = answer_schema(req.response_format)
    tools = (raw.get("tools") or []) if tools_on else []
    forced = forced_tools(req.tool_choice, tools) if tools_on else None
    if forced is not None:
        answer, tools = None, forced
    elif answer is None:
        return None  # tools on "auto" alone: the model may answer in any text
    if tokenizer is None:
        raise RequestError("structured outputs need the model's tokenizer", grammar_param(req))
    try:
        return chat_output(arch, tokenizer, answer=answer, tools=tools or None)
    except ValueError as e:
        raise RequestError(str(e), "tool_choice" if forced is not None else "response_format") from None


async def compile_off_loop(engine: Any, grammar: Grammar | None, param: str) -> None:
    """Compile `grammar` in a worker thread (into the compiler's cache); a grammar llguidance refuses is a
    400 naming `param`."""
    if grammar is None:
        return
    config, tokenizer = engine.model.config, engine.tokenizer
    try:
        await in_thread(
            compile_grammar, grammar, tokenizer, config.vocab_size, stop_token_ids(tokenizer, config)
        )
    except ValueError as e:
        raise RequestError(str(e), param) from None


def grammar_param(req: ChatCompletionRequest) -> str:
    """The field a grammar error is about: the tools when a call is forced, else the response_format."""
    return (
        "tools" if req.tool_choice == "required" or isinstance(req.tool_choice, dict) else "response_format"
    )
