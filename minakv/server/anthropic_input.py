"""Anthropic Messages requests -> the chat request the rest of the server already handles.

`POST /v1/messages` is a second spelling of a chat conversation, so it is converted once, here, into the
OpenAI-style chat messages and tools that /v1/chat/completions renders (prompts.chat_prompt), and from
then on the two endpoints share everything: the chat template, token ownership, cache operations, the
engine, the output parser. Only the wire format differs.

Anthropic content blocks and chat messages are not one to one, and cache operations name chat messages,
so the numbering is part of the API (docs/server.md, "Anthropic Messages"):

- `system`, when the request has it (a string or text blocks, joined), is chat message 0;
- every assistant message is one chat message: its `text` blocks joined as `content`, its `thinking`
  blocks joined as `reasoning_content` (the template decides where reasoning is printed: MiniMax-M2
  keeps it after the last user turn, as `<think>...</think>`), its `tool_use` blocks as `tool_calls`;
- a user message with string content is one chat message; with blocks, each `tool_result` is one `tool`
  message and each run of consecutive `text` blocks one `user` message, in block order.

`Conversation.origins` remembers the request field each chat message came from, so errors found later
(by the renderer or the engine) can name the field the client wrote.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from msgspec import Struct

from minakv.server.protocol import CacheForm, ChatCompletionRequest, ChatMessage, DropRule, RequestError, Tool


class TextPart(Struct):
    """A block of `system` or of a tool_result's content (only text is supported there)."""

    type: str
    text: str | None = None


class Block(Struct):
    """Any content block; which fields it needs depends on `type` (checked in `to_chat`). Fields minakv
    does not use (`cache_control`, `citations`, ...) are ignored."""

    type: str
    text: str | None = None
    thinking: str | None = None  # thinking
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[TextPart] | None = None
    is_error: bool | None = None


class AnthropicMessage(Struct):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolDef(Struct):
    name: str
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None  # "custom" or absent; Anthropic's server tools (web_search_..., ...) have others


class ToolChoice(Struct):
    type: str
    name: str | None = None
    disable_parallel_tool_use: bool | None = None  # not enforced: it would need constrained decoding


class OutputConfig(Struct):
    effort: str | None = None  # low, medium, high, xhigh, max: the template's reasoning_effort (GPT-OSS)
    format: dict[str, Any] | None = None  # structured outputs: refused (no constrained decoding yet)


class MessagesRequest(Struct, kw_only=True):
    model: str
    max_tokens: int  # required, as in Anthropic's API
    messages: list[AnthropicMessage]
    system: str | list[TextPart] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = None  # ignored
    thinking: dict[str, Any] | None = None  # ignored: the model family decides whether it reasons
    output_config: OutputConfig | None = None
    # cache operations, the same fields as on chat completions (cache_ops.py), over chat message ids
    cache: CacheForm | None = None
    drop_message: dict[int, list[int]] | None = None
    drop_rule: DropRule | None = None
    reposition: list[int] | None = None


@dataclass
class Conversation:
    messages: list[dict[str, Any]] = field(default_factory=list)  # chat messages, as the template gets them
    tools: list[dict[str, Any]] | None = None  # chat tools (OpenAI function form)
    origins: list[str] = field(default_factory=list)  # per chat message: the request field it came from

    def add(self, message: dict[str, Any], origin: str) -> None:
        self.messages.append(message)
        self.origins.append(origin)

    def field_name(self, param: str | None) -> str | None:
        """A chat-side field name (`messages[3].content`) as the client wrote it
        (`messages[1].content[2].content`)."""
        match = re.match(r"messages\[(\d+)\]", param or "")
        if match is None or int(match.group(1)) >= len(self.origins):
            return param
        return self.origins[int(match.group(1))] + param[match.end() :]  # type: ignore[index]


def to_chat(req: MessagesRequest) -> Conversation:
    """The chat messages and tools of `req`, numbered as the module docstring says."""
    if not req.messages:
        raise RequestError("messages must not be empty", "messages")
    if req.messages[-1].role == "assistant":
        raise RequestError(
            "a final assistant message (prefill) is not supported: the chat template would close it and "
            "start a new reply",
            f"messages[{len(req.messages) - 1}]",
        )
    conv = Conversation(tools=chat_tools(req.tools) if req.tools else None)
    if req.system is not None:
        conv.add({"role": "system", "content": system_text(req.system)}, "system")
    names: dict[str, str] = {}  # tool_use id -> tool name, to name the tool messages that answer it
    for k, m in enumerate(req.messages):
        where = f"messages[{k}]"
        if isinstance(m.content, str):
            conv.add({"role": m.role, "content": m.content}, where)
            continue
        if not m.content:
            raise RequestError("content must not be an empty list", f"{where}.content")
        if m.role == "assistant":
            conv.add(assistant_message(m.content, where, names), where)
        else:
            for message, origin in user_messages(m.content, where, names):
                conv.add(message, origin)
    return conv


def system_text(system: str | list[TextPart]) -> str:
    if isinstance(system, str):
        return system
    for j, b in enumerate(system):
        if b.type != "text" or b.text is None:
            raise RequestError(f"system blocks must be text blocks, got type {b.type!r}", f"system[{j}]")
    return "".join(b.text for b in system)  # type: ignore[misc]


def need(value: Any, name: str, where: str) -> Any:
    if value is None:
        raise RequestError(f"this block needs `{name}`", f"{where}.{name}")
    return value


def assistant_message(blocks: list[Block], where: str, names: dict[str, str]) -> dict[str, Any]:
    texts, thoughts, calls = [], [], []
    for j, b in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if b.type == "text":
            texts.append(need(b.text, "text", at))
        elif b.type == "thinking":
            thoughts.append(need(b.thinking, "thinking", at))
        elif b.type == "redacted_thinking":
            continue  # encrypted reasoning of Anthropic's own models: nothing a template could print
        elif b.type == "tool_use":
            call_id, name = need(b.id, "id", at), need(b.name, "name", at)
            names[call_id] = name
            # the input dict goes to the template as is (it prints arguments from a mapping)
            calls.append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": b.input or {}}}
            )
        else:
            raise RequestError(
                f"unsupported block type {b.type!r} in an assistant message (supported: text, thinking, "
                "redacted_thinking, tool_use)",
                f"{at}.type",
            )
    # no empty reasoning_content or tool_calls keys: templates test for their presence
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if "".join(thoughts):
        message["reasoning_content"] = "".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return message


def user_messages(blocks: list[Block], where: str, names: dict[str, str]) -> list[tuple[dict[str, Any], str]]:
    """One `tool` message per tool_result, one `user` message per run of text blocks, in block order."""
    out: list[tuple[dict[str, Any], str]] = []
    run: list[str] = []
    run_at = ""
    for j, b in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if b.type == "text":
            run_at = run_at if run else at
            run.append(need(b.text, "text", at))
        elif b.type == "tool_result":
            if run:
                out.append(({"role": "user", "content": "".join(run)}, run_at))
                run = []
            call_id = need(b.tool_use_id, "tool_use_id", at)
            message = {"role": "tool", "tool_call_id": call_id}
            if call_id in names:
                message["name"] = names[call_id]
            # is_error has no place in the chat templates: the result text is rendered as it is
            message["content"] = result_text(b.content, at)
            out.append((message, at))
        else:
            raise RequestError(
                f"unsupported block type {b.type!r} in a user message (supported: text, tool_result)",
                f"{at}.type",
            )
    if run:
        out.append(({"role": "user", "content": "".join(run)}, run_at))
    return out


def result_text(content: str | list[TextPart] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise RequestError(
                f"only text blocks are supported in a tool_result, got type {part.type!r}",
                f"{where}.content[{j}]",
            )
    return "".join(part.text for part in content)  # type: ignore[misc]


def chat_tools(tools: list[ToolDef]) -> list[dict[str, Any]]:
    out = []
    for i, t in enumerate(tools):
        if t.type not in (None, "custom"):
            raise RequestError(
                f"tool type {t.type!r} (an Anthropic server tool) is not supported; give custom tools "
                "(name, description, input_schema)",
                f"tools[{i}].type",
            )
        function: dict[str, Any] = {"name": t.name}
        if t.description is not None:
            function["description"] = t.description
        function["parameters"] = need(t.input_schema, "input_schema", f"tools[{i}]")
        out.append({"type": "function", "function": function})
    return out


def tool_choice(req: MessagesRequest) -> str:
    """The chat endpoint's tool_choice: 'auto' (tools rendered, calls parsed) or 'none' (no tools)."""
    choice = req.tool_choice.type if req.tool_choice is not None else "auto"
    if choice in ("auto", "none"):
        return choice
    if choice in ("any", "tool"):
        raise RequestError(
            f"tool_choice {choice!r} needs constrained decoding, which minakv does not have yet; "
            "use 'auto' or 'none'",
            "tool_choice",
        )
    raise RequestError(
        f"tool_choice.type must be 'auto', 'any', 'tool' or 'none', got {choice!r}", "tool_choice"
    )


# output_config.effort -> the template's reasoning_effort (the chat templates know low, medium and high)
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


def chat_request(req: MessagesRequest, conv: Conversation) -> ChatCompletionRequest:
    """The same request as a typed chat request: what prompts.sampling_params and prompts.chat_prompt check
    (chat_prompt takes `conv` as the raw messages and tools)."""
    effort = req.output_config.effort if req.output_config is not None else None
    if req.output_config is not None and req.output_config.format is not None:
        raise RequestError(
            "output_config.format (structured outputs) needs constrained decoding, which minakv does not "
            "have yet",
            "output_config.format",
        )
    if effort is not None and effort not in EFFORTS:
        raise RequestError(
            f"output_config.effort must be one of {list(EFFORTS)}, got {effort!r}", "output_config.effort"
        )
    return ChatCompletionRequest(
        model=req.model,
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        stop=req.stop_sequences,
        messages=[msgspec.convert(m, ChatMessage) for m in conv.messages],
        tools=[msgspec.convert(t, Tool) for t in conv.tools] if conv.tools else None,
        tool_choice=tool_choice(req),
        reasoning_effort=EFFORTS[effort] if effort is not None else None,
        cache=req.cache,
        drop_message=req.drop_message,
        drop_rule=req.drop_rule,
        reposition=req.reposition,
    )
