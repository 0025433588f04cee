"""Cache keys: what a page of KV *is*, so two requests share a page only when it holds the very same KV.

A request's pages hold its entries in plan order (minakv/cache/plan.py): a BORN entry is a token's K/V at
its birth position, a COPY entry is a surviving key re-rotated to its rank by a reposition. What an entry
holds depends on the token, on everything before it, on every drop and reposition before it
(docs/design.md 2.5), and on the position its key is rotated at. Its record names all of that:

    record = events digest | token id | position | kind     (kind: B for born, C<from> for a copy)

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

if TYPE_CHECKING:  # plan.py imports this module: the type only, no import cycle at run time
    from minakv.cache.plan import Entry


ROOT = b"minakv-cache-v2"  # the chain's start, with the page size (a new version tag matches no old key)


@dataclass(frozen=True)
class PageKey:
    key: bytes  # hash chain of the records of this page and every page before it
    dropped: bool  # every entry of the page is dropped by the end of the request (evict these first)


def hash_parts(*parts: bytes) -> bytes:
    """One link of a hash chain."""
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part)
    return h.digest()


def record(digest: bytes, token: int, entry: Entry, source_position: int | None = None) -> bytes:
    """What an entry holds: token `token` after the events in `digest`, rotated at `entry.position`
    (a copy also names the position it was rotated from, which with the digest pins its source)."""
    kind = b"B" if source_position is None else b"C%d" % source_position
    return b"%s|%d|%d|%s;" % (digest, token, entry.position, kind)


def page_keys(records: Sequence[bytes], page_size: int, dead: Sequence[bool] | None = None) -> list[PageKey]:
    """Chained keys of the full pages of `records` (`dead[p]`: page p holds only dropped entries)."""
    prev = hash_parts(ROOT, b"%d" % page_size)  # the same records in pages of another size are other pages
    keys = []
    for p in range(len(records) // page_size):
        prev = hash_parts(prev, *records[p * page_size : (p + 1) * page_size])
        keys.append(PageKey(prev, bool(dead and dead[p])))
    return keys
