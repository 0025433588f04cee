"""Parsed model output -> Anthropic content blocks, stream events, stop reason and usage.

The family's output parser (output.ChatParser over minakv/text/parsers.py) turns the model's text into
pieces: reasoning, content, tool-call pieces. An Anthropic reply is those pieces as content blocks, in the
order the model wrote them: a run of reasoning is a `thinking` block, a run of content a `text` block,
each tool call a `tool_use` block. `Blocks` turns pieces into stream events and keeps the blocks they
describe, so a non-streamed reply is exactly what a client assembles from the stream (the handler runs the
same loop both ways and only decides whether the events are sent).

A tool_use block's input must be a JSON object, and clients parse `input_json_delta` as it arrives, so a
call's argument text is held until the call is complete and sent as one delta: MiniMax-M2 calls are
complete when they appear anyway; GPT-OSS arguments are the model's raw JSON, and text that is not a JSON
object becomes `{"raw_arguments": text}` rather than an error.
"""

from __future__ import annotations

import json
from typing import Any

from minakv.outputs import Usage
from minakv.text.parsers import Piece

KIND_TO_BLOCK = {"reasoning": ("thinking", "thinking_delta"), "content": ("text", "text_delta")}


class Blocks:
    """Pieces -> content blocks (`self.content`) and the stream events that build them."""

    def __init__(self) -> None:
        self.content: list[dict[str, Any]] = []
        self.open_kind: str | None = None  # the piece kind of the open block (None: no block is open)
        self.open_call = -1  # the parser's index of the open tool call
        self.arguments = ""  # the open tool call's argument text so far

    @property
    def called(self) -> bool:
        return any(b["type"] == "tool_use" for b in self.content)

    def add(self, pieces: list[Piece]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for p in pieces:
            continues_call = p.kind == "tool_call" and p.id is None and p.index == self.open_call
            if p.kind != self.open_kind or (p.kind == "tool_call" and not continues_call):
                events += self.close()
                events.append(self.start(p))
            if p.kind == "tool_call":
                self.arguments += p.text
            elif p.text:
                block_field, delta_type = KIND_TO_BLOCK[p.kind]
                self.content[-1][block_field] += p.text
                events.append(block_delta(len(self.content) - 1, {"type": delta_type, block_field: p.text}))
        return events

    def start(self, p: Piece) -> dict[str, Any]:
        self.open_kind = p.kind
        if p.kind == "tool_call":
            block = {"type": "tool_use", "id": p.id or "", "name": p.name or "", "input": {}}
            self.open_call, self.arguments = p.index, ""
        else:
            block_field = KIND_TO_BLOCK[p.kind][0]
            block = {"type": block_field, block_field: ""}
            if p.kind == "reasoning":
                block["signature"] = ""  # Anthropic signs its own reasoning; minakv has nothing to sign
        self.content.append(block)
        return {"type": "content_block_start", "index": len(self.content) - 1, "content_block": dict(block)}

    def close(self) -> list[dict[str, Any]]:
        """End the open block (at a change of kind and at the end of the output)."""
        if self.open_kind is None:
            return []
        index, events = len(self.content) - 1, []
        if self.open_kind == "tool_call":
            self.content[index]["input"] = tool_input(self.arguments)
            partial = json.dumps(self.content[index]["input"], ensure_ascii=False)
            events.append(block_delta(index, {"type": "input_json_delta", "partial_json": partial}))
            self.open_call = -1
        self.open_kind = None
        events.append({"type": "content_block_stop", "index": index})
        return events


def block_delta(index: int, delta: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index, "delta": delta}


def tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"raw_arguments": arguments}


def stop_reason(finish_reason: str | None, called: bool, stop_sequence: str | None) -> str:
    if finish_reason == "length":
        return "max_tokens"
    if called:
        return "tool_use"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def matched_stop(tokenizer: Any, output_ids: list[int], text: str, stops: list[str] | None) -> str | None:
    """Which of `stops` ended the output, if one did. The engine cuts the text just before the stop string
    it found and reports only "stop", so the string is the one that the full decode of the output tokens
    continues with after the text (an end-of-sequence token adds its own marker, never a client's string)."""
    if not stops or tokenizer is None:
        return None
    full = tokenizer.decode(output_ids)
    return next((s for s in stops if full.startswith(s, len(text))), None)


def usage(u: Usage) -> dict[str, int]:
    """Anthropic's usage: input_tokens are the prompt tokens not read from the cache (its total input is
    input + cache_read + cache_creation). minakv caches every prompt without being asked, so nothing counts
    as an explicit cache write. The cache-operation counters ride along as on chat completions."""
    return {
        "input_tokens": max(u.prompt_tokens - u.cached_tokens, 0),
        "output_tokens": u.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens,
        "repos_tokens": u.repos_tokens,
        "drop_skipped_tokens": u.drop_skipped_tokens,
    }


def message(
    message_id: str,
    model: str,
    content: list[dict[str, Any]],
    reason: str | None,
    stop_sequence: str | None,
    counts: dict[str, int],
) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": stop_sequence,
        "usage": counts,
    }
