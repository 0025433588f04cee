"""Engine increments -> OpenAI response pieces: parsed chat messages and deltas, and logprobs.

The model writes one text stream; a chat response separates it into `reasoning_content`, `content` and
`tool_calls` with the family's output parser (minakv/text/parsers.py: harmony channels for GPT-OSS,
`<think>` and `<minimax:tool_call>` for MiniMax-M2). Streaming feeds the same parser increment by
increment, so the deltas add up to the non-streamed message.
"""

from __future__ import annotations

import functools
import uuid
from typing import Any

from minakv.outputs import RequestOutput, TokenLogprob
from minakv.server.protocol import (
    ChoiceLogprobs,
    CompletionLogprobs,
    Delta,
    FunctionCallDelta,
    FunctionCallOut,
    ResponseMessage,
    TokenLogprobInfo,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
)
from minakv.text import parsers
from minakv.text.parsers import make_parser
from minakv.text.tokenizer import byte_to_unicode


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_unicode().items()}


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The exact bytes of one token (byte-level BPE pieces mapped back; others as UTF-8)."""
    if tokenizer is None:
        return str(token_id).encode()
    piece = tokenizer.id_to_token(token_id)
    if piece is None:
        return b""
    table = _unicode_to_byte()
    if all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    return piece.encode()


def token_text(tokenizer: Any, token_id: int) -> str:
    return token_bytes(tokenizer, token_id).decode("utf-8", errors="replace")


def chat_logprobs(tokenizer: Any, lps: list[TokenLogprob]) -> list[TokenLogprobInfo]:
    def top(tid: int, lp: float) -> TopLogprob:
        b = token_bytes(tokenizer, tid)
        return TopLogprob(b.decode("utf-8", errors="replace"), lp, list(b))

    out = []
    for lp in lps:
        b = token_bytes(tokenizer, lp.token_id)
        out.append(
            TokenLogprobInfo(
                b.decode("utf-8", errors="replace"), lp.logprob, list(b), [top(t, v) for t, v in lp.top]
            )
        )
    return out


class CompletionLogprobsBuilder:
    """Legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, engine: Any, offset: int = 0) -> None:
        self.tokenizer = engine.tokenizer
        self.offset = offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float] = []
        self.top: list[dict[str, float]] = []
        self.text_offset: list[int] = []

    def add(self, out: RequestOutput) -> CompletionLogprobsBuilder:
        for lp in out.logprobs or []:
            text = token_text(self.tokenizer, lp.token_id)
            self.tokens.append(text)
            self.token_logprobs.append(lp.logprob)
            self.top.append({token_text(self.tokenizer, t): v for t, v in lp.top})
            self.text_offset.append(self.offset)
            self.offset += len(text)
        return self

    def build(self) -> CompletionLogprobs:
        return CompletionLogprobs(self.tokens, self.token_logprobs, self.top, self.text_offset)


class ChatParser:
    """Accumulates a chat response from increments: `deltas` while streaming, `message` at the end. The
    family's output parser holds back text that may still turn into a tag, so the streamed deltas add up
    to exactly the non-streamed message."""

    def __init__(self, arch: str | None, tokenizer: Any, tools: list[dict] | None) -> None:
        """`arch`: the model family (`ModelConfig.arch`) choosing the output format; `tools`: the
        request's tools (MiniMax types parameter values by their schema)."""
        self.tokenizer = tokenizer
        self.parser = make_parser(arch, tools, id_prefix=f"call_{uuid.uuid4().hex[:16]}_")
        self.parsed: list[parsers.Piece] = []
        self.lps: list[TokenLogprob] | None = None

    def step(self, out: RequestOutput) -> list[parsers.Piece]:
        if out.logprobs is not None:
            self.lps = (self.lps or []) + out.logprobs
        new = self.parser.feed(out.text)
        if out.finished:
            new = parsers.merge(new + self.parser.finish())
        self.parsed += new
        return new

    def deltas(self, out: RequestOutput) -> list[tuple[Delta, ChoiceLogprobs | None]]:
        """The chunks for one increment: its parsed pieces, the increment's logprobs on the first."""
        pieces = [wire_delta(d) for d in self.step(out)]
        lps = ChoiceLogprobs(chat_logprobs(self.tokenizer, out.logprobs)) if out.logprobs else None
        if lps is not None and not pieces:
            pieces = [Delta()]
        return [(d, lps if i == 0 else None) for i, d in enumerate(pieces)]

    def message(self, finish_reason: str | None) -> tuple[ResponseMessage, str | None]:
        parsed = parsers.collect(self.parsed)
        calls = [ToolCallOut(c.id, FunctionCallOut(c.name, c.arguments)) for c in parsed.tool_calls]
        return ResponseMessage(
            parsed.content, reasoning_content=parsed.reasoning_content, tool_calls=calls
        ), (self.finish_reason(finish_reason))

    def finish_reason(self, reason: str | None) -> str | None:
        called = any(d.kind == "tool_call" for d in self.parsed)
        return "tool_calls" if called and reason == "stop" else reason

    def logprobs_all(self) -> ChoiceLogprobs | None:
        return ChoiceLogprobs(chat_logprobs(self.tokenizer, self.lps)) if self.lps is not None else None


def wire_delta(d: parsers.Piece) -> Delta:
    if d.kind == "reasoning":
        return Delta(reasoning_content=d.text)
    if d.kind == "content":
        return Delta(content=d.text)
    fn = FunctionCallDelta(name=d.name, arguments=d.text)
    return Delta(tool_calls=[ToolCallDelta(d.index, d.id, "function" if d.id else None, fn)])
