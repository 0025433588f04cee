"""`POST /v1/responses`, the output side: parsed pieces -> output items, stream events and the response.

The chat parser (output.ChatParser over minakv/text/parsers.py) turns the model's text into pieces of
three kinds: reasoning, content and tool calls. A Responses output is a list of items, and the pieces map
onto it in order: a run of reasoning is a `reasoning` item (its text as one `reasoning_text` part), a run
of content a `message` item (one `output_text` part), each tool call a `function_call` item (call_id,
name, arguments). An item opens at the first piece of a new kind, or of a new call, and closes at the next.

Streamed and whole responses run the same `add`, so the streamed items are the whole response's items and
the deltas concatenate to their text. Each item streams as

    response.output_item.added
    response.content_part.added                  (reasoning and message items)
    response.reasoning_text.delta | response.output_text.delta | response.function_call_arguments.delta
    response.reasoning_text.done  | response.output_text.done  | response.function_call_arguments.done
    response.content_part.done                   (reasoning and message items)
    response.output_item.done

between `response.created` + `response.in_progress` and one of `response.completed`, `response.incomplete`
(the output was cut at max_output_tokens or the model's length) or `response.failed` (the engine failed).
Every event carries a `sequence_number`, counting from 0.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from minakv.outputs import RequestOutput
from minakv.server.responses import ResponsesRequest
from minakv.server.running import usage_info
from minakv.text.parsers import Piece

ID_PREFIX = {"reasoning": "rs", "content": "msg", "tool_call": "fc"}


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class Item:
    """One output item as it grows; `wire` renders it (a fresh dict each time, so an event keeps the item
    as it was when the event was made)."""

    kind: str  # the piece kind: "reasoning", "content" or "tool_call"
    id: str
    text: str = ""  # reasoning text, message text or call arguments
    call_id: str = ""
    name: str = ""
    status: str = "in_progress"

    def part(self) -> dict[str, Any]:
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": self.text}
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}

    def wire(self, with_part: bool = True) -> dict[str, Any]:
        parts = [self.part()] if with_part else []
        if self.kind == "reasoning":
            return {
                "id": self.id,
                "type": "reasoning",
                "summary": [],
                "content": parts,
                "status": self.status,
            }
        if self.kind == "content":
            return {"id": self.id, "type": "message", "role": "assistant", "status": self.status,
                    "content": parts}  # fmt: skip
        return {"id": self.id, "type": "function_call", "call_id": self.call_id, "name": self.name,
                "arguments": self.text, "status": self.status}  # fmt: skip

    def where(self, at: int) -> dict[str, Any]:
        """The fields that place a text event: the item, and its one content part (calls have none)."""
        if self.kind == "tool_call":
            return {"item_id": self.id, "output_index": at}
        logprobs = {"logprobs": []} if self.kind == "content" else {}  # not supported: always empty
        return {"item_id": self.id, "output_index": at, "content_index": 0, **logprobs}


# per item kind: the name of its text events (.delta, .done) and the .done field holding the whole text
TEXT_EVENTS = {
    "reasoning": ("response.reasoning_text", "text"),
    "content": ("response.output_text", "text"),
    "tool_call": ("response.function_call_arguments", "arguments"),
}


def flat_tool(chat_tool: dict[str, Any]) -> dict[str, Any]:
    """A chat-form tool echoed back in the Responses form."""
    return {"type": "function", **chat_tool["function"]}


class ResponseBuilder:
    """The response of one request: feed it parsed pieces (`add`), then `finish` or `fail`. Every method
    returns the stream events it made; a non-streamed request ignores them and sends `response()`."""

    def __init__(
        self, rid: str, model: str, req: ResponsesRequest, tools: list[dict] | None, tokenizer: Any
    ) -> None:
        self.id, self.model, self.req, self.tokenizer = rid, model, req, tokenizer
        self.tools = [flat_tool(t) for t in tools or []]
        self.created_at = int(time.time())
        self.items: list[Item] = []
        self.open: Item | None = None
        self.sequence = 0
        self.status, self.completed_at = "in_progress", None
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.incomplete: dict[str, Any] | None = None

    def event(self, type: str, **fields: Any) -> dict[str, Any]:
        event = {"type": type, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        return [self.event("response.created", response=self.response()),
                self.event("response.in_progress", response=self.response())]  # fmt: skip

    def add(self, pieces: list[Piece]) -> list[dict[str, Any]]:
        events = []
        for piece in pieces:
            new_call = piece.kind == "tool_call" and piece.id is not None
            if self.open is None or new_call or piece.kind != self.open.kind:
                events += self.close("completed")
                events += self.open_item(piece)
            if piece.text:
                events += self.delta(piece.text)
        return events

    def open_item(self, piece: Piece) -> list[dict[str, Any]]:
        item = Item(
            piece.kind, new_item_id(ID_PREFIX[piece.kind]), call_id=piece.id or "", name=piece.name or ""
        )
        self.items.append(item)
        self.open, at = item, len(self.items) - 1
        events = [self.event("response.output_item.added", output_index=at, item=item.wire(with_part=False))]
        if item.kind != "tool_call":
            events.append(self.event("response.content_part.added", item_id=item.id, output_index=at,
                                     content_index=0, part=item.part()))  # fmt: skip
        return events

    def delta(self, text: str) -> list[dict[str, Any]]:
        item, at = self.open, len(self.items) - 1
        assert item is not None
        item.text += text
        return [self.event(f"{TEXT_EVENTS[item.kind][0]}.delta", **item.where(at), delta=text)]

    def close(self, status: str) -> list[dict[str, Any]]:
        item, at = self.open, len(self.items) - 1
        if item is None:
            return []
        self.open, item.status = None, status
        name, field = TEXT_EVENTS[item.kind]
        named = {"name": item.name} if item.kind == "tool_call" else {}
        events = [self.event(f"{name}.done", **item.where(at), **named, **{field: item.text})]
        if item.kind != "tool_call":
            events.append(self.event("response.content_part.done", item_id=item.id, output_index=at,
                                     content_index=0, part=item.part()))  # fmt: skip
        return events + [self.event("response.output_item.done", output_index=at, item=item.wire())]

    def finish(self, out: RequestOutput) -> list[dict[str, Any]]:
        """The end of a run: `out` is the last increment (finished, with the usage)."""
        cut = out.finish_reason == "length"
        events = self.close("incomplete" if cut else "completed")
        self.status, self.completed_at = ("incomplete" if cut else "completed"), int(time.time())
        self.incomplete = {"reason": "max_output_tokens"} if cut else None
        self.usage = usage(out, self.reasoning_tokens())
        return events + [self.event(f"response.{self.status}", response=self.response())]

    def fail(self, message: str) -> list[dict[str, Any]]:
        """The engine failed after the stream started."""
        events = self.close("incomplete")
        self.status, self.error = "failed", {"code": "server_error", "message": message}
        return events + [self.event("response.failed", response=self.response())]

    def reasoning_tokens(self) -> int:
        """The reasoning text re-tokenized: the parser works on text, so the exact tokens are not tracked."""
        text = "".join(i.text for i in self.items if i.kind == "reasoning")
        return len(self.tokenizer.encode(text)) if text and self.tokenizer is not None else 0

    def response(self) -> dict[str, Any]:
        req = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
            "completed_at": self.completed_at, "error": self.error, "incomplete_details": self.incomplete,
            "model": self.model, "output": [i.wire() for i in self.items] if self.status != "in_progress" else [],
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": self.tools,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "text": {"format": {"type": "text"}}, "truncation": req.truncation or "disabled",
            "previous_response_id": None, "store": False, "metadata": req.metadata or {}, "user": req.user,
            "usage": self.usage,
        }  # fmt: skip


def usage(out: RequestOutput, reasoning_tokens: int) -> dict[str, Any]:
    """The engine's usage in the Responses names; minakv's cache counters ride along in
    input_tokens_details. cache_write_tokens: the prompt tokens this request computed (not read from the
    cache, not skipped), whose KV the prefix cache keeps for later requests."""
    u = usage_info(out)
    d = u.prompt_tokens_details
    details = {
        "cached_tokens": d.cached_tokens,
        "cache_write_tokens": max(0, u.prompt_tokens - d.cached_tokens - d.drop_skipped_tokens),
        "repos_tokens": d.repos_tokens,
        "drop_skipped_tokens": d.drop_skipped_tokens,
    }
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": details,
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, u.completion_tokens)},
        "total_tokens": u.total_tokens,
    }
