"""Tokenizing a rendered conversation message by message, with a cache of the messages seen before.

An agent resends its whole history every round, and the server renders and tokenizes all of it again:
100k tokens of text is ~0.3 s of tokenizer and Python per request, while the engine reuses the KV of all
but the newest message. Most of that text was tokenized in the previous round, message for message.

Why tokenizing piece by piece is exact here: a tokenizer first cuts its input at its added tokens (the
chat format's specials, `<|start|>`, `]~b]`, ...) and only then runs the normalizer, the pre-tokenizer and
BPE inside each cut. So if every boundary between two owner runs (minakv/text/chat.py) touches an added
token, encoding each run alone gives the same tokens as encoding the whole text:

    text    | <|start|>user<|message|>hi<|end|> | <|start|>assistant<|channel|>... |
    runs      owner 1                              owner 2
    boundary: the next run starts with the special `<|start|>`  -> safe, encode the runs apart

A boundary counts as safe only next to a plain added token (no lstrip/rstrip/single_word, not matched on
normalized text), whose match cannot reach across it. When a boundary is not safe (a template that glues
messages with ordinary text), `encode_runs` says so and the caller encodes the whole text as before.
The real templates of both families are checked against whole-text encoding in tests/test_chat_pieces.py.

The cache maps a run's text to its tokens and their character offsets (numpy, relative to the run), in
LRU order within a budget of tokens, shared by the server's worker threads under a lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from itertools import pairwise
from typing import Any

import numpy as np

Encoded = tuple[np.ndarray, np.ndarray]  # ids [n] int64, offsets [n, 2] int64 (relative to the run's text)


class PieceCache:
    def __init__(self, tokenizer: Any, max_tokens: int = 4_000_000) -> None:
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.entries: OrderedDict[str, Encoded] = OrderedDict()
        self.tokens = 0
        self.hits = self.misses = 0
        self.lock = threading.Lock()
        self.markers = safe_markers(tokenizer)

    def encode(self, piece: str) -> Encoded:
        with self.lock:
            found = self.entries.get(piece)
            if found is not None:
                self.entries.move_to_end(piece)
                self.hits += 1
                return found
        ids, offsets = self.tokenizer.encode_with_offsets(piece)  # outside the lock: it releases the GIL
        found = (np.asarray(ids, dtype=np.int64), np.asarray(offsets, dtype=np.int64).reshape(-1, 2))
        with self.lock:
            self.misses += 1
            if piece not in self.entries and len(ids) <= self.max_tokens:
                self.entries[piece] = found
                self.tokens += len(ids)
                while self.tokens > self.max_tokens:
                    _, old = self.entries.popitem(last=False)
                    self.tokens -= len(old[0])
        return found

    def safe(self, before: str, after: str) -> bool:
        """May the text be cut between `before` and `after` without changing its tokens?"""
        return before.endswith(self.markers) or after.startswith(self.markers)


def safe_markers(tokenizer: Any) -> tuple[str, ...]:
    """The added tokens whose match never reaches past their own text (empty: cut nowhere)."""
    inner = getattr(tokenizer, "tok", None)
    if inner is None or not hasattr(inner, "get_added_tokens_decoder"):
        return ()
    tokens = inner.get_added_tokens_decoder().values()
    plain = (t.content for t in tokens if not (t.lstrip or t.rstrip or t.single_word or t.normalized))
    return tuple(c for c in plain if c)


def encode_runs(
    cache: PieceCache, text: str, runs: list[tuple[int, int]]
) -> tuple[list[int], list[int], np.ndarray] | None:
    """(ids, owners, character spans [T, 2]) of `text`, each owner run encoded apart (through the cache),
    or None when some boundary between runs is not safe to cut at."""
    if not runs:
        return [], [], np.zeros((0, 2), np.int64)
    edges = [0, *(start for start, _ in runs[1:]), len(text)]  # (the first run starts at 0: chat.py)
    pieces = [text[a:b] for a, b in pairwise(edges)]
    if not all(cache.safe(a, b) for a, b in pairwise(pieces)):
        return None
    encoded = [cache.encode(piece) for piece in pieces]
    ids = np.concatenate([e[0] for e in encoded])
    owners = np.repeat([owner for _, owner in runs], [len(e[0]) for e in encoded])
    spans = np.concatenate([e[1] + start for e, start in zip(encoded, edges)])
    return ids.tolist(), owners.tolist(), spans
