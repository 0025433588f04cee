"""The index of cached pages: find reusable KV for a new request, remember finished KV, evict.

One dictionary over the page keys of `keys.py`:

    by_key: key -> the cached page (a request with that key shares it as is: incref)

`match(keys)` walks a request's page keys in order and gives, per page, the cached page or None. It does
not stop at a missing page: an evicted page leaves a hole, and the pages after it still match, because
their keys never depend on what is cached. `plan.entries_to_compute` then decides which missing entries
must really be recomputed.

The index holds one pool reference per indexed page. Eviction takes pages nobody else holds
(refcount 1), least recently used first, but pages whose entries are all dropped (no live request of that
history can read them again) before any other.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter

import numpy as np

from minakv.cache.keys import PageKey
from minakv.cache.pool import PagePool, PoolError


@dataclass
class CachedPage:
    page: int
    key: bytes
    dropped: bool  # all its entries are dropped on the history that last inserted it
    last_used: int


class PageIndex:
    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.by_key: dict[bytes, CachedPage] = {}
        self.by_page: dict[int, CachedPage] = {}
        self.page_of: dict[bytes, int] = {}  # by_key's pages alone: `pages` looks a long history up in C
        # LRU order (oldest first), dropped-only pages apart: eviction scans dropped pages, then the rest.
        self.lru: dict[bool, OrderedDict[int, CachedPage]] = {True: OrderedDict(), False: OrderedDict()}
        self.clock = 0

    def __len__(self) -> int:
        return len(self.by_page)

    def held_pages(self) -> list[int]:
        """The pages the index holds a reference on (its view, for `PagePool.check`)."""
        return list(self.by_page)

    def _touch(self, entry: CachedPage, dropped: bool | None = None) -> None:
        """Mark as most recently used (and, if given, update whether it holds only dropped entries)."""
        self.clock += 1
        entry.last_used = self.clock
        self.lru[entry.dropped].pop(entry.page, None)
        if dropped is not None:
            entry.dropped = dropped
        self.lru[entry.dropped][entry.page] = entry

    def match(self, keys: Sequence[PageKey], touch: bool = True) -> list[int | None]:
        """Per page key: the cached page with exactly that KV, or None. Touches what it finds (LRU), unless
        told not to (the caller then touches the pages it uses).

        Take a pool reference on the pages you use (`pool.incref`) before evicting anything: an
        eviction may otherwise free a matched page and hand it out again."""
        out: list[int | None] = []
        for key in keys:
            entry = self.by_key.get(key.key)
            if entry is not None and touch:
                self._touch(entry)
            out.append(entry.page if entry is not None else None)
        return out

    def pages(self, keys: Sequence[PageKey]) -> np.ndarray:
        """`match` without touching, as int64 pages with -1 where nothing is cached: one dictionary lookup per
        key inside `map`, no Python loop (an agent's history has thousands of pages)."""
        found = map(self.page_of.get, map(attrgetter("key"), keys), repeat(-1))
        return np.fromiter(found, dtype=np.int64, count=len(keys))

    def touch(self, pages: Sequence[int], dropped: bool | None = None) -> None:
        """Mark cached pages as just used; `dropped=True` also puts them first in line for eviction (no
        live request reads them any more)."""
        # `_touch` inlined: admission touches every page it takes or retires, thousands for a long history.
        # A page staying in its list just moves to the end (one C call instead of a pop and an insert).
        by_page, lru, clock = self.by_page, self.lru, self.clock
        for page in pages:
            entry = by_page.get(page)
            if entry is None:
                continue
            clock += 1
            entry.last_used = clock
            if dropped is None or dropped == entry.dropped:
                lru[entry.dropped].move_to_end(page)
            else:
                del lru[entry.dropped][page]
                entry.dropped = dropped
                lru[dropped][page] = entry
        self.clock = clock

    def insert(self, keys: Sequence[PageKey], pages: Sequence[int]) -> list[bool]:
        """Index each full page under its key (taking a pool reference). A key already cached keeps its
        page (the caller keeps its duplicate privately); returns, per page, whether it was indexed."""
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
        out = []
        for key, page in zip(keys, pages):
            entry = self.by_key.get(key.key)
            if entry is not None:
                self._touch(entry, key.dropped)  # the latest history's view of the page
                out.append(entry.page == page)
                continue
            if page in self.by_page:
                raise PoolError(f"page {page} is already indexed under another key")
            self.pool.incref([page])
            entry = CachedPage(page, key.key, key.dropped, 0)
            self._touch(entry)
            self.by_key[key.key] = entry
            self.by_page[page] = entry
            self.page_of[key.key] = page
            out.append(True)
        return out

    def evictable(self) -> int:
        """Cached pages nobody but the index holds (counted in C: the index may hold tens of thousands)."""
        return list(map(self.pool.refcount.__getitem__, self.by_page)).count(1)

    def evict(self, n: int) -> list[int]:
        """Free up to n pages nobody but the index holds: dropped-only pages first, then LRU.

        Pages held by a request that the scan passes on its way to a freed page are as good as just used, so
        they move to the end and later scans skip them. Those after the last freed page stay put: that makes
        evict(n) leave the index exactly as n calls of evict(1) would, so pages can be allocated in bulk."""
        freed: list[int] = []
        refcount = self.pool.refcount
        for dropped in (True, False):
            lru, in_use, passed = self.lru[dropped], [], 0
            for page in lru:
                if len(freed) == n:
                    break
                if refcount[page] == 1:
                    freed.append(page)
                    passed = len(in_use)
                else:
                    in_use.append(page)
            for page in in_use[:passed]:
                lru.move_to_end(page)
        for page in freed:
            self.remove(page)
        return freed

    def remove(self, page: int) -> None:
        """Forget a page and let go of the index's reference (it is freed if nobody else holds it)."""
        entry = self.by_page.pop(page)
        del self.lru[entry.dropped][page]
        del self.by_key[entry.key]
        del self.page_of[entry.key]
        self.pool.decref([page])
