"""Cache keys: what a page of KV *is*, so two requests share it only when it is truly the same KV.

A token's K/V depends on the token, on everything before it, and on every drop and reposition before it
(docs/design.md 2.5); its stored key is also rotated at some position. So per token we form a record
(events before it, token id) and chain records page by page, like vLLM's prefix-cache hash chain:

    page 0           page 1                       page 2
    [t0 t1 t2 t3] -> [t4 t5 D(0,2) R t6 t7] -> ...   D(lo,hi) = tokens lo..hi-1 dropped here, R = reposition
    agnostic_0 = H(root, records_0)
    agnostic_1 = H(agnostic_0, records_1)            <- the whole history, but no positions
    exact_k    = H(agnostic_k, positions of page k)  <- the KV rotated at exactly these positions

- `agnostic` identifies the raw (un-rotated) KV: same tokens, same operations before them. A cached page
  with an equal agnostic key can be reused at other positions by copying it into a fresh page and
  re-rotating (position-agnostic matching).
- `exact` adds the positions the page's keys are rotated at (for an active token its final position, for
  a dropped one the position it last held): an equal exact key means the page can be shared as is.

A reposition that changes no position emits no record, so it does not create a new version. Dropped tokens
stay in the chain: what comes after them was computed while they were visible. Page keys never depend on
which pages are cached, so after an evicted page (a hole) the next pages still match.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from minakv.cache.program import NEVER, Program

TOKEN, DROP, REPOSITION = 0, 1, 2  # record kinds: (TOKEN, token_id, 0), (DROP, lo, hi), (REPOSITION, 0, 0)


@dataclass(frozen=True)
class PageKey:
    index: int  # page number along the path: tokens [index * page_size, (index + 1) * page_size)
    agnostic: bytes  # hash chain of (events, token) records: the raw KV's identity
    exact: bytes  # agnostic + this page's positions: the stored (rotated) KV's identity
    positions: tuple[int, ...]  # position each slot's key is rotated at
    dropped: bool  # every token of the page is dropped by the end of the program (evict these first)


def hash_parts(*parts: bytes) -> bytes:
    """One link of a hash chain (shared by the engine's page keys)."""
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part)
    return h.digest()


def root_key(page_size: int) -> bytes:
    return hash_parts(b"minakv-cache-v1", np.int64(page_size).tobytes())


def records(program: Program, token_ids: Sequence[int], lo: int, hi: int) -> np.ndarray:
    """The int64 [R, 3] records of tokens [lo, hi): events before each token, then the token."""
    tokens = np.asarray(token_ids[lo:hi], dtype=np.int64)
    rows = np.zeros((hi - lo, 3), dtype=np.int64)
    rows[:, 0], rows[:, 1] = TOKEN, tokens
    points = program.cut_points(lo - 1, hi).tolist()  # event points in [lo, hi)
    if not points:
        return rows
    parts, done = [], lo
    for point in points:
        parts.append(rows[done - lo : point - lo])
        ranges, reposition = program.events_at(point)
        events = [(DROP, a, b) for a, b in ranges] + ([(REPOSITION, 0, 0)] if reposition else [])
        parts.append(np.asarray(events, dtype=np.int64).reshape(-1, 3))
        done = point
    parts.append(rows[done - lo :])
    return np.concatenate(parts)


def key_positions(program: Program, length: int) -> np.ndarray:
    """The position each token's cached key is kept at: prompt tokens at their last position (final if
    active), generated tokens at their birth position."""
    prompt = program.last_positions[:length]
    generated = program.birth_positions(np.arange(program.num_tokens, length))
    return np.concatenate([prompt, generated]).astype(np.int64)


def page_keys(program: Program, token_ids: Sequence[int], page_size: int) -> list[PageKey]:
    """Keys of the full pages of `token_ids` (the prompt, optionally followed by generated tokens)."""
    if len(token_ids) < program.num_tokens:
        raise ValueError(f"{len(token_ids)} token ids for a program of {program.num_tokens} tokens")
    positions = key_positions(program, len(token_ids))
    dropped = program.drop_points(np.arange(len(token_ids))) != NEVER
    parent, keys = root_key(page_size), []
    for index in range(len(token_ids) // page_size):
        lo, hi = index * page_size, (index + 1) * page_size
        agnostic = hash_parts(parent, records(program, token_ids, lo, hi).tobytes())
        exact = hash_parts(agnostic, positions[lo:hi].tobytes())
        keys.append(
            PageKey(index, agnostic, exact, tuple(positions[lo:hi].tolist()), bool(dropped[lo:hi].all()))
        )
        parent = agnostic
    return keys
