"""The index of cached pages: find reusable KV for a new request, remember finished KV, evict.

Two dictionaries over the page keys of `keys.py`:

    exact:    exact key    -> the cached page (share it as is: incref)
    agnostic: agnostic key -> cached pages with that raw KV at some positions (copy + re-rotate)

`match(keys)` walks a request's page keys in order and says, per page, "exact" (share), "rerotate" (copy
this page into a fresh one, re-rotating each slot from its old position to the new one; never in place,
other requests may share it) or None (not cached). It does not stop at a missing page: an evicted page
leaves a hole, and the pages after it still match, because their keys never depend on what is cached.
`restore.plan_restore` then decides which missing tokens must really be recomputed.

The index holds one pool reference per indexed page. Eviction takes pages nobody else holds
(refcount 1), least recently used first, but pages whose tokens are all dropped (no live request of that
history can read them again) before any other.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from minakv.cache.keys import PageKey
from minakv.cache.pool import PagePool, PoolError


@dataclass
class CachedPage:
    page: int
    key: PageKey
    dropped: bool  # all its tokens are dropped on the history that last inserted it
    last_used: int


@dataclass(frozen=True)
class Match:
    kind: str  # "exact" (share the page) or "rerotate" (copy it, re-rotating old -> new positions)
    page: int
    old_positions: tuple[int, ...]
    new_positions: tuple[int, ...]


class PageIndex:
    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.exact: dict[bytes, CachedPage] = {}
        self.agnostic: dict[bytes, dict[int, CachedPage]] = {}
        self.by_page: dict[int, CachedPage] = {}
        # LRU order (oldest first), dropped-only pages apart: eviction scans dropped pages, then the rest.
        self.lru: dict[bool, OrderedDict[int, CachedPage]] = {True: OrderedDict(), False: OrderedDict()}
        self.clock = 0

    def __len__(self) -> int:
        return len(self.by_page)

    def held_pages(self) -> list[int]:
        """The pages the index holds a reference on (its view, for `PagePool.check`)."""
        return list(self.by_page)

    def _touch(self, entry: CachedPage, dropped: bool | None = None) -> None:
        """Mark as most recently used (and, if given, update whether it holds only dropped tokens)."""
        self.clock += 1
        entry.last_used = self.clock
        self.lru[entry.dropped].pop(entry.page, None)
        if dropped is not None:
            entry.dropped = dropped
        self.lru[entry.dropped][entry.page] = entry

    def match(self, keys: Sequence[PageKey]) -> list[Match | None]:
        """Per page key: how to reuse cached KV for it, or None. Touches what it finds (LRU).

        Take a pool reference on the pages you use (`pool.incref`) before evicting anything: an
        eviction may otherwise free a matched page and hand it out again."""
        out: list[Match | None] = []
        for key in keys:
            entry = self.exact.get(key.exact)
            kind = "exact"
            if entry is None:
                versions = self.agnostic.get(key.agnostic)
                entry = max(versions.values(), key=lambda e: e.last_used) if versions else None
                kind = "rerotate"
            if entry is None:
                out.append(None)
                continue
            self._touch(entry)
            out.append(Match(kind, entry.page, entry.key.positions, key.positions))
        return out

    def insert(self, keys: Sequence[PageKey], pages: Sequence[int]) -> list[bool]:
        """Index each full page under its key (taking a pool reference). A key already cached keeps its
        page (the caller keeps its duplicate privately); returns, per page, whether it was indexed."""
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
        out = []
        for key, page in zip(keys, pages):
            entry = self.exact.get(key.exact)
            if entry is not None:
                self._touch(entry, key.dropped)  # the latest history's view of the page
                out.append(entry.page == page)
                continue
            if page in self.by_page:
                raise PoolError(f"page {page} is already indexed under another key")
            self.pool.incref([page])
            entry = CachedPage(page, key, key.dropped, 0)
            self._touch(entry)
            self.exact[key.exact] = entry
            self.agnostic.setdefault(key.agnostic, {})[page] = entry
            self.by_page[page] = entry
            out.append(True)
        return out

    def evictable(self) -> int:
        return sum(1 for e in self.by_page.values() if self.pool.refcount[e.page] == 1)

    def evict(self, n: int) -> list[int]:
        """Free up to n pages nobody but the index holds: dropped-only pages first, then LRU."""
        freed: list[int] = []
        for dropped in (True, False):
            for page in self.lru[dropped]:
                if len(freed) == n:
                    break
                if self.pool.refcount[page] == 1:
                    freed.append(page)
        for page in freed:
            self.remove(page)
        return freed

    def remove(self, page: int) -> None:
        """Forget a page and let go of the index's reference (it is freed if nobody else holds it)."""
        entry = self.by_page.pop(page)
        del self.lru[entry.dropped][page]
        del self.exact[entry.key.exact]
        versions = self.agnostic[entry.key.agnostic]
        del versions[page]
        if not versions:
            del self.agnostic[entry.key.agnostic]
        self.pool.decref([page])
