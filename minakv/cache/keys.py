"""Cache keys: what a page of KV *is*, so two requests share a page only when it holds the very same KV.

A request's pages hold its entries in plan order (minakv/cache/plan.py): a BORN entry is a token's K/V at
its birth position, a COPY entry is a surviving key re-rotated to its rank by a reposition. What an entry
holds depends on the token, on everything before it, on every drop and reposition before it
(docs/design.md 2.5), and on the position its key is rotated at. Its record names all of that:

    record = events digest | token id | position | source position   (-1 for born, else a copy's old one)

and a page's key chains its records onto the previous page's key, like vLLM's prefix-cache hash chain:

    page 0            page 1                       page 2
    [e0 e1 e2 e3] ->  [e4 e5 e6 e7]            ->  ...
    key_0 = H(root, records_0)
    key_1 = H(key_0, records_1)                <- the whole history up to the end of page 1

So the same text after another history never shares a key, a reposition's copies are pages of their own
(exact, since each record names its position), and a reposition that changes no position adds no event,
so it makes no new version. Dropped entries stay in the chain: what comes after them was computed while
they were visible. Keys never depend on which pages are cached, so after an evicted page (a hole) the
pages after it still match.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # plan.py imports this module: the type only, no import cycle at run time
    from minakv.cache.plan import Entry


ROOT = b"minakv-cache-v2"  # the chain's start, with the page size (a new version tag matches no old key)


@dataclass(slots=True, unsafe_hash=True)  # not frozen: a frozen dataclass costs twice as much to make, and
class PageKey:  # planning makes one per page (treat it as immutable all the same)
    key: bytes  # hash chain of the records of this page and every page before it
    dropped: bool  # every entry of the page is dropped by the end of the request (evict these first)


def hash_parts(*parts: bytes) -> bytes:
    """One link of a hash chain."""
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part)
    return h.digest()


def digest_words(digest: bytes) -> np.ndarray:
    """An events digest (16 bytes, or empty before any event) as two int64 words of a record."""
    return np.frombuffer(digest.ljust(16, b"\0"), dtype=np.int64)


def record(digest: bytes, token: int, entry: Entry, source_position: int | None = None) -> np.ndarray:
    """What an entry holds, as one int64 row: the events digest (two words), the token id, the position
    its key is rotated at, and for a copy the position it was rotated from (-1 for a born entry), which
    with the digest pins its source."""
    src = -1 if source_position is None else source_position
    return np.array([*digest_words(digest), token, entry.position, src], dtype=np.int64)


def page_keys(
    records: np.ndarray | Sequence[np.ndarray],
    page_size: int,
    dead: Sequence[bool] | None = None,
    parent: bytes | None = None,
) -> list[PageKey]:
    """Chained keys of the full pages of `records` ([E, 5] rows; `dead[p]`: page p holds only entries no
    live key reads); `parent`: the key of the page before the first one (None: the chain's root)."""
    rows = np.ascontiguousarray(np.asarray(records, dtype=np.int64).reshape(-1, 5))
    # the same records in pages of another size are other pages
    prev = parent if parent is not None else hash_parts(ROOT, b"%d" % page_size)
    data, step = rows.tobytes(), page_size * rows.shape[1] * 8
    flags = list(dead) if dead is not None and len(dead) else [False] * (len(rows) // page_size)
    keys = []
    view = memoryview(data)
    for p in range(len(rows) // page_size):  # hash_parts(prev, page), inlined: this loop runs per page
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(view[p * step : (p + 1) * step])  # a view: no copy of the page's bytes
        prev = h.digest()
        keys.append(PageKey(prev, bool(flags[p])))
    return keys
