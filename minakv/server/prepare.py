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
import numpy as np

from minakv.cache.program import compile_program
from minakv.cache.validate import CacheOpError
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
    # the position of the first generated token: num_tokens, unless repositions renumbered the history;
    # None if unknown (invalid cache operations, which the engine refuses naming the field)
    next_pos: int | None


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
    """The engine's tokenizer, refusing a text that is certainly longer than `max_tokens` tokens before
    tokenizing it. Everything but `encode_with_offsets` and `encode` is the tokenizer's own (chat template,
    special tokens)."""

    def __init__(self, tokenizer: Any, max_tokens: int, why: str, param: str) -> None:
        self.tokenizer, self.max_tokens, self.why, self.param = tokenizer, max_tokens, why, param
        self.longest = longest_token(tokenizer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)

    def check(self, text: str) -> None:
        if self.longest is not None and len(text) > self.longest * self.max_tokens:
            raise RequestError(
                f"the prompt is {len(text)} characters long, so it has more than {self.max_tokens} tokens "
                f"({self.why}); no token of this model is longer than {self.longest} characters",
                self.param,
                code="context_length_exceeded",
            )

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        self.check(text)
        return self.tokenizer.encode(text, allow_special)

    def encode_with_offsets(self, text: str, allow_special: bool = True) -> tuple[list[int], list]:
        self.check(text)
        return self.tokenizer.encode_with_offsets(text, allow_special)


def bounded(engine: Engine, repositions: bool, param: str) -> Bounded:
    """The tokenizer with the longest prompt that can run: max_model_len bounds positions, so without
    repositions the tokens too; with repositions a history may be longer (they renumber it), up to what
    the KV pool holds."""
    if not repositions:
        return Bounded(engine.tokenizer, engine.max_model_len, "max_model_len", param)
    pool = engine.stats()["pages_total"] * engine.config.page_size
    return Bounded(engine.tokenizer, pool, "the KV pool's size", param)


def first_position(form: dict[str, Any]) -> int | None:
    """Where the first generated token of a message_tokens prompt sits: after its last token, unless
    repositions renumber the history (docs/design.md 2.2); then the program is compiled, as the engine will
    do, to know. None if the operations are invalid."""
    lists = form["message_tokens"]
    cache = form.get("cache") or {}
    if not cache.get("reposition"):
        return sum(map(len, lists))
    owners = np.repeat(np.arange(len(lists)), [len(part) for part in lists])
    try:
        return compile_program(owners, len(lists), cache.get("drop"), cache.get("reposition")).next_pos
    except CacheOpError:
        return None


def chat_tokens(
    engine: Engine, prompt: dict[str, Any], ops: CacheOps | None, param: str = "messages"
) -> Tokenized:
    """A messages prompt (prompts.chat_prompt) in token form; thinking_drop cuts messages into parts."""
    from minakv.server.prompts import thinking_drop_prompt  # prompts.py imports nothing from here

    tokenizer = bounded(
        engine, bool((prompt.get("cache") or {}).get("reposition") or (ops and ops.reposition)), param
    )
    if ops is not None and ops.thinking_drop:
        out = thinking_drop_prompt(tokenizer, prompt, ops)
        return Tokenized(out, sum(map(len, out["message_tokens"])), first_position(out))
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
    return Tokenized(form, len(rendered.token_ids), first_position(form))


def to_tokens(engine: Engine, prompt: Any, ops: CacheOps | None = None, param: str = "prompt") -> Tokenized:
    """Any engine prompt in token form. Prompts already in it pass through (the engine checks them), and
    so does text for a model without a tokenizer, which the engine refuses with its own message."""
    if isinstance(prompt, list):
        return Tokenized(prompt, len(prompt), len(prompt))
    if isinstance(prompt, dict) and isinstance(prompt.get("message_tokens"), list):
        parts = [m for m in prompt["message_tokens"] if isinstance(m, list)]
        valid = len(parts) == len(prompt["message_tokens"])
        return Tokenized(prompt, sum(map(len, parts)), first_position(prompt) if valid else None)
    if engine.tokenizer is None:
        return Tokenized(prompt, 0, None)
    if isinstance(prompt, str):
        ids = bounded(engine, False, param).encode(prompt)
        return Tokenized(ids, len(ids), len(ids))
    if isinstance(prompt, dict) and "messages" in prompt:
        return chat_tokens(engine, prompt, ops, param)
    return Tokenized(prompt, 0, None)
