"""`POST /v1/responses`, the input side: a Responses request -> the chat request the server already runs.

The Responses API describes a conversation as a list of items (messages, reasoning, function calls and
their outputs) next to `instructions`; chat templates know messages. So a request is converted once, here,
into the chat messages that /v1/chat/completions would have been sent for the same conversation, and from
then on the endpoints share everything: rendering with token ownership, cache operations, thinking_drop,
sampling parameters, the output parser.

Items and chat messages are not one to one, and cache operations name chat messages, so the numbering
is part of the API (docs/server.md, "Responses"):

- `instructions`, when given, is message 0, a system message;
- a `message` item with role user, system or developer is one message; a `function_call_output` item one
  tool message;
- assistant-side items in a row (`reasoning`, assistant `message`, `function_call`) are ONE assistant
  message with reasoning_content, content and tool_calls, the way the chat endpoint returns a turn. A new
  assistant message starts where the order reasoning -> content -> calls goes back: a `reasoning` or an
  assistant `message` item after content or a call.

A conversation that went back and forth through /v1/responses therefore renders to the same tokens as it
would have through /v1/chat/completions, and the two share cached prefixes. The server is stateless:
`previous_response_id`, `conversation` and item references would need stored responses, and get a 400.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec
from msgspec import Struct

from minakv.server.protocol import CacheForm, ChatCompletionRequest, ChatMessage, DropRule, RequestError, Tool


class Reasoning(Struct):
    effort: str | None = None
    summary: str | None = None  # accepted; the reasoning itself is returned, never a summary


class TextFormat(Struct):
    type: str = "text"


class TextConfig(Struct):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(Struct, kw_only=True):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: Reasoning | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None  # accepted, but nothing is stored
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None
    text: TextConfig | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    truncation: str | None = None
    user: str | None = None
    # the chat endpoint's extra sampling fields (vLLM's spelling), through extra_body
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # cache operations, in either spelling (cache_ops.py), over the chat messages numbered as above
    cache: CacheForm | None = None
    drop_message: dict[int, list[int]] | None = None
    drop_rule: DropRule | None = None
    reposition: list[int] | None = None


def check_request(req: ResponsesRequest) -> None:
    """What a stateless server without constrained decoding cannot do, refused by name."""
    stored = {"previous_response_id": req.previous_response_id, "conversation": req.conversation}
    for name, value in stored.items():
        if value is not None:
            raise RequestError(
                f"{name} is not supported: this server is stateless and stores no responses; send the whole "
                "conversation as `input` items every time",
                name,
            )
    if req.background:
        raise RequestError("background responses are not supported (nothing is stored)", "background")
    if req.prompt is not None:
        raise RequestError("stored prompt templates (`prompt`) are not supported", "prompt")
    if req.text is not None and req.text.format is not None and req.text.format.type != "text":
        raise RequestError("text.format other than 'text' needs constrained decoding", "text.format")
    if req.top_logprobs or "message.output_text.logprobs" in (req.include or []):
        raise RequestError("logprobs are not supported on /v1/responses", "top_logprobs")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise RequestError(
            f"max_output_tokens must be a positive integer, got {req.max_output_tokens}", "max_output_tokens"
        )
    effort = req.reasoning.effort if req.reasoning else None
    if effort is not None and effort not in ("low", "medium", "high"):
        raise RequestError(
            f"reasoning.effort must be 'low', 'medium' or 'high', got {effort!r}", "reasoning.effort"
        )


# ---------------------------------------------------------------------------------------------------------
# Input items


class Part(Struct):
    type: str
    text: str | None = None


class MessageItem(Struct):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Part]


class ReasoningItem(Struct):
    summary: list[Part] = []
    content: list[Part] | None = None
    encrypted_content: str | None = None


class CallItem(Struct):
    call_id: str
    name: str
    arguments: str


class CallOutputItem(Struct):
    call_id: str
    output: str | list[Part]


ITEMS = {"message": MessageItem, "reasoning": ReasoningItem, "function_call": CallItem,
         "function_call_output": CallOutputItem}  # fmt: skip
_PATH = re.compile(r"`\$\.?([^`]*)`")


def read_item(item: Any, where: str) -> Any:
    """One input item as its typed struct, errors naming `where` (e.g. `input[3].call_id`)."""
    if not isinstance(item, dict):
        raise RequestError(f"{where} must be an object", where)
    kind = item.get("type", "message" if "role" in item else None)  # messages may omit their type
    if kind not in ITEMS:
        why = " (item references need stored responses)" if kind == "item_reference" else ""
        raise RequestError(
            f"input item type {kind!r} is not supported{why}; supported: {', '.join(ITEMS)}", f"{where}.type"
        )
    try:
        return msgspec.convert(item, ITEMS[kind])
    except msgspec.ValidationError as e:
        match = _PATH.search(str(e))
        param = f"{where}.{match.group(1)}" if match and match.group(1) else where
        raise RequestError(f"Invalid {kind} item: {e}", param.replace(".[", "[")) from None


def text_of(content: str | list[Part], where: str, kinds: tuple[str, ...]) -> str:
    """A message's text: the string, or its text parts joined (other parts: 400)."""
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if part.type not in kinds or part.text is None:
            raise RequestError(
                f"only {' and '.join(kinds)} parts are supported, got {part.type!r}", f"{where}[{j}]"
            )
    return "".join(p.text or "" for p in content)


class Conversation:
    """Chat messages built item by item; `origins[i]` is the request field chat message i came from."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.origins: list[str] = []
        self.turn: dict[str, Any] | None = None  # the assistant message still taking items

    def add(self, message: dict[str, Any], origin: str) -> None:
        self.messages.append(message)
        self.origins.append(origin)
        self.turn = None

    def assistant(self, origin: str, starts_after: tuple[str, ...]) -> dict[str, Any]:
        """The open assistant message, or a new one if it already has any of `starts_after`."""
        if self.turn is None or any(self.turn.get(k) for k in starts_after):
            self.add({"role": "assistant", "content": None}, origin)
            self.turn = self.messages[-1]
        return self.turn


def to_messages(req: ResponsesRequest) -> Conversation:
    """The chat messages of `instructions` + `input`, numbered as the module docstring says."""
    conv = Conversation()
    if req.instructions is not None:
        conv.add({"role": "system", "content": req.instructions}, "instructions")
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for j, raw in enumerate(items):
        where = "input" if isinstance(req.input, str) else f"input[{j}]"
        item = read_item(raw, where)
        if isinstance(item, MessageItem) and item.role != "assistant":
            text = text_of(item.content, f"{where}.content", ("input_text", "text"))
            conv.add({"role": item.role, "content": text}, where)
        elif isinstance(item, MessageItem):
            turn = conv.assistant(where, ("content", "tool_calls"))
            turn["content"] = text_of(item.content, f"{where}.content", ("output_text", "text"))
        elif isinstance(item, ReasoningItem):
            if item.encrypted_content:
                raise RequestError("encrypted reasoning cannot be read here", f"{where}.encrypted_content")
            parts = item.content if item.content else item.summary  # the text itself, else its summary
            text = "".join(p.text or "" for p in parts)
            turn = conv.assistant(where, ("content", "tool_calls"))
            turn["reasoning_content"] = (turn.get("reasoning_content") or "") + text
        elif isinstance(item, CallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
            turn = conv.assistant(where, ())
            turn.setdefault("tool_calls", []).append(call)
        else:
            text = text_of(item.output, f"{where}.output", ("input_text", "output_text", "text"))
            conv.add({"role": "tool", "tool_call_id": item.call_id, "content": text}, where)
    if not conv.messages:
        raise RequestError("input must not be empty", "input")
    return conv


# ---------------------------------------------------------------------------------------------------------
# Tools and the chat request


def chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A Responses function tool (flat: type, name, description, parameters, strict) in the chat form;
    the chat form itself is accepted too. Other tool types (web_search, mcp, ...) run on OpenAI's side."""
    if tool.get("type") != "function":
        raise RequestError(f"only function tools are supported, got {tool.get('type')!r}", f"tools[{i}].type")
    fn = (
        tool["function"]
        if isinstance(tool.get("function"), dict)
        else {k: v for k, v in tool.items() if k != "type"}
    )
    if not isinstance(fn.get("name"), str):
        raise RequestError("a function tool needs a string `name`", f"tools[{i}].name")
    return {"type": "function", "function": fn}


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """The chat spelling: strings as they are, a named function nested under `function`. The chat endpoint
    then takes "auto" and "none" and refuses the rest (they need constrained decoding)."""
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def to_chat(req: ResponsesRequest) -> tuple[ChatCompletionRequest, dict[str, Any], Conversation]:
    """The typed chat request (for the shared checks), the raw messages and tools the template gets, and
    the conversation (for the origins of the messages)."""
    check_request(req)
    conv = to_messages(req)
    tools = [chat_tool(t, i) for i, t in enumerate(req.tools)] if req.tools else None
    try:
        messages = msgspec.convert(conv.messages, list[ChatMessage])
        typed_tools = msgspec.convert(tools, list[Tool] | None)
    except msgspec.ValidationError as e:
        raise RequestError(f"Invalid request: {e}", "input") from None
    chat = ChatCompletionRequest(
        model=req.model,
        messages=messages,
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        stream=req.stream,
        tools=typed_tools,
        tool_choice=chat_tool_choice(req.tool_choice),
        reasoning_effort=req.reasoning.effort if req.reasoning else None,
        cache=req.cache,
        drop_message=req.drop_message,
        drop_rule=req.drop_rule,
        reposition=req.reposition,
    )
    return chat, {"messages": conv.messages, "tools": tools}, conv


def input_param(param: str | None, conv: Conversation) -> str | None:
    """A param naming a chat message (`messages[2].content`, from the renderer) as the request field."""
    match = re.match(r"messages\[(\d+)\]", param or "")
    if match is None or int(match.group(1)) >= len(conv.origins):
        return param
    return conv.origins[int(match.group(1))]
