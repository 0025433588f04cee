"""Turning a request into tokens off the event loop.

Decoding a body, rendering the chat template and tokenizing cost time in proportion to the request. On the
event loop that time is taken from everyone: one 30 MB request froze `/health` and every other stream for
20 s. So the handlers do that work in a worker thread (`asyncio.to_thread`; the tokenizer releases the GIL,
Jinja and msgspec hold it only in short slices) and hand the engine a prompt that is already tokens, so
`engine.stream` has nothing heavy left to do on the loop.

The token form of a chat prompt is the engine's `{"message_tokens": [...], "cache": {...}}` with one token
list per message, in order, plus a last one for the generation prompt: token list i is owned by message i,
so the client's cache operations keep their meaning unchanged. One difference needs care: in the token form
the generation prompt is message N of N + 1, so operations after the last message (future events, which
the engine ignores in the messages form) are left out here.

A prompt that cannot fit is refused before it is tokenized where its length already tells: a byte-level
tokenizer (no normalizer, every byte of the text lands in some token) makes one token of at most `longest`
characters, its longest vocabulary entry, so a rendered text of more than `longest * max_model_len`
characters has more than max_model_len tokens.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass
from itertools import groupby
from typing import Any, TypeVar

import msgspec

from minakv.engine import Engine
from minakv.server.cache_ops import CacheOps
from minakv.server.protocol import RequestError, decode_request
from minakv.text.chat import render

# bodies past this size are decoded in the worker thread; a smaller one decodes faster than the thread hop
LARGE_BODY = 256 << 10
T = TypeVar("T")


@dataclass
class Tokenized:
    prompt: Any  # an engine prompt in token form: a list of token ids, or a message_tokens dict
    num_tokens: int


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.to_thread(fn, *args)


async def decode(body: bytes, type: type, raw: bool = False) -> tuple[Any, Any]:
    """The body as `type` (errors name the field) and, with `raw`, also as plain JSON values."""

    def both() -> tuple[Any, Any]:
        typed = decode_request(body, type)
        return typed, msgspec.json.decode(body) if raw else None

    return await in_thread(both) if len(body) > LARGE_BODY else both()


# ---------------------------------------------------------------------------------------------------------
# Tokenizing (these run in the worker thread)


@functools.lru_cache(maxsize=8)
def longest_token(tokenizer: Any) -> int | None:
    """Characters in the longest vocabulary entry, if the tokenizer is byte-level (else no bound holds: a
    normalizer or a removing pre-tokenizer can swallow characters)."""
    hf = getattr(tokenizer, "tok", None)
    if hf is None or hf.normalizer is not None:
        return None
    steps = repr(hf.pre_tokenizer)
    if "ByteLevel(" not in steps or "behavior=Removed" in steps:
        return None
    return max(map(len, hf.get_vocab(with_added_tokens=True)))


class Bounded:
    """The engine's tokenizer, refusing a text that is certainly too long before tokenizing it. Everything
    but `encode_with_offsets` and `encode` is the tokenizer's own (chat template, special tokens)."""

    def __init__(self, tokenizer: Any, max_model_len: int, param: str) -> None:
        self.tokenizer, self.param, self.max_model_len = tokenizer, param, max_model_len
        longest = longest_token(tokenizer)
        self.max_chars = longest * max_model_len if longest else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)

    def check(self, text: str) -> None:
        if self.max_chars is not None and len(text) > self.max_chars:
            raise RequestError(
                f"the prompt is {len(text)} characters long, so it has more than {self.max_model_len} tokens "
                f"(max_model_len); no token of this model is longer than {self.max_chars // self.max_model_len} "
                "characters",
                self.param,
                code="context_length_exceeded",
            )

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        self.check(text)
        return self.tokenizer.encode(text, allow_special)

    def encode_with_offsets(self, text: str, allow_special: bool = True) -> tuple[list[int], list]:
        self.check(text)
        return self.tokenizer.encode_with_offsets(text, allow_special)


def chat_tokens(
    engine: Engine, prompt: dict[str, Any], ops: CacheOps | None, param: str = "messages"
) -> Tokenized:
    """A messages prompt (prompts.chat_prompt) in token form; thinking_drop cuts messages into parts."""
    from minakv.server.prompts import thinking_drop_prompt  # prompts.py imports nothing from here

    tokenizer = Bounded(engine.tokenizer, engine.max_model_len, param)
    if ops is not None and ops.thinking_drop:
        out = thinking_drop_prompt(tokenizer, prompt, ops)
        return Tokenized(out, sum(map(len, out["message_tokens"])))
    kwargs = prompt.get("chat_template_kwargs") or {}
    rendered = render(prompt["messages"], tokenizer, tools=prompt.get("tools"), **kwargs)
    n = rendered.num_messages
    lists: list[list[int]] = [[] for _ in range(n + 1)]
    for owner, run in groupby(zip(rendered.owners, rendered.token_ids), key=lambda pair: pair[0]):
        lists[owner] = [token for _, token in run]
    cache = prompt.get("cache") or {}
    drop = {trigger: ids for trigger, ids in (cache.get("drop") or {}).items() if trigger < n}
    reposition = [m for m in cache.get("reposition") or [] if m < n]
    form = {"message_tokens": lists, "cache": {"drop": drop, "reposition": reposition}}
    return Tokenized(form, len(rendered.token_ids))


def to_tokens(engine: Engine, prompt: Any, ops: CacheOps | None = None, param: str = "prompt") -> Tokenized:
    """Any engine prompt in token form. Prompts already in it pass through (the engine checks them), and
    so does text for a model without a tokenizer, which the engine refuses with its own message."""
    if isinstance(prompt, list):
        return Tokenized(prompt, len(prompt))
    if isinstance(prompt, dict) and isinstance(prompt.get("message_tokens"), list):
        return Tokenized(prompt, sum(len(m) for m in prompt["message_tokens"] if isinstance(m, list)))
    if engine.tokenizer is None:
        return Tokenized(prompt, 0)
    if isinstance(prompt, str):
        ids = Bounded(engine.tokenizer, engine.max_model_len, param).encode(prompt)
        return Tokenized(ids, len(ids))
    if isinstance(prompt, dict) and "messages" in prompt:
        return chat_tokens(engine, prompt, ops, param)
    return Tokenized(prompt, 0)
