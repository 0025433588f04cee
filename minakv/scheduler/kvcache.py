"""The scheduler's view of KV memory: the page pool plus the index of cached pages.

A page is held by requests (while they run) and by the index (while it is cached). The index maps a page
key (hash chain over entry records, see minakv/scheduler/plan.py) to a page. Pages only the index holds
are evictable, least recently used first, with pages that hold only dropped entries (no continuation of the
request that published them can read them) before all others.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from minakv.cache.pool import PagePool


class KVCache:
    def __init__(self, num_pages: int, page_size: int, enabled: bool = True) -> None:
        self.pool = PagePool(num_pages, page_size)
        self.page_size = page_size
        self.enabled = enabled
        self.by_key: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached pages, least recently used first
        self.dead: set[int] = set()  # cached pages holding only dropped entries
        self.evictions = 0

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    def keys(self, records: list[bytes]) -> list[bytes]:
        """Chained keys of the full pages of `records`."""
        keys, prev = [], b""
        for p in range(len(records) // self.page_size):
            h = hashlib.blake2b(prev, digest_size=16)
            for r in records[p * self.page_size : (p + 1) * self.page_size]:
                h.update(r)
            prev = h.digest()
            keys.append(prev)
        return keys

    def match(self, keys: list[bytes]) -> list[int]:
        """Pages for the longest prefix of `keys` that is cached."""
        pages = []
        if self.enabled:
            for key in keys:
                page = self.by_key.get(key)
                if page is None:
                    break
                pages.append(page)
        return pages

    def _evictable(self, page: int) -> bool:
        return self.pool.refcount[page] == 1  # only the index holds it

    def available(self, exclude: list[int] = ()) -> int:
        """Pages a request could get now: free ones plus evictable cached ones (not those in `exclude`)."""
        skip = set(exclude)
        return self.pool.num_free + sum(1 for p in self.lru if p not in skip and self._evictable(p))

    def acquire(self, pages: list[int]) -> list[int]:
        for p in pages:
            self.pool.incref([p])
            self.lru.move_to_end(p)
        return list(pages)

    def allocate(self) -> int | None:
        """A fresh page, evicting one cached page if none is free; None if nothing can be had."""
        if not self.pool.num_free and not self._evict_one():
            return None
        return self.pool.allocate(1)[0]

    def _evict_one(self) -> bool:
        order = [p for p in self.lru if p in self.dead] + [p for p in self.lru if p not in self.dead]
        for p in order:
            if self._evictable(p):
                del self.by_key[self.key_of.pop(p)]
                del self.lru[p]
                self.dead.discard(p)
                self.pool.decref([p])
                self.evictions += 1
                return True
        return False

    def release(self, pages: list[int], keys: list[bytes], dead: list[bool]) -> None:
        """A request lets go of `pages`; the first len(keys) are complete and are offered to the index."""
        for i, page in enumerate(pages):
            if self.enabled and i < len(keys) and keys[i] not in self.by_key and page not in self.key_of:
                self.by_key[keys[i]] = page
                self.key_of[page] = keys[i]
                self.pool.incref([page])
                if dead[i]:
                    self.dead.add(page)
            if page in self.lru or page in self.key_of:
                self.lru[page] = None
                self.lru.move_to_end(page)
            self.pool.decref([page])

    def check(self, holders: list[list[int]]) -> None:
        """Exact accounting: every reference is a running request's page or a cached page."""
        self.pool.check([*holders, list(self.key_of)])
        assert set(self.lru) == set(self.key_of), "LRU and index disagree"

    def stats(self) -> dict:
        return {
            "pages_total": self.pool.num_pages,
            "pages_free": self.pool.num_free,
            "pages_cached": len(self.key_of),
            "pages_used": self.pool.num_pages - self.pool.num_free,
            "evictions": self.evictions,
        }
