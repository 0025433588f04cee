"""The scheduler's view of KV memory: the page pool and the index of cached pages (minakv.cache).

A page is held by the requests that run on it and by the index while it is cached. A request's pages hold
its entries in plan order (minakv/cache/plan.py), so a page's key is the hash chain of its entries'
records (minakv/cache/keys.py). Each record already names its position (a re-rotated copy is an entry of
its own), so a key match means the page can be shared as is.
Eviction is the index's: pages only the index holds, dropped-only pages first, then least recently used.
"""

from __future__ import annotations

import numpy as np

from minakv.cache.index import PageIndex
from minakv.cache.keys import PageKey
from minakv.cache.pool import PagePool


class KVCache:
    def __init__(self, num_pages: int, page_size: int, enabled: bool = True) -> None:
        self.pool = PagePool(num_pages, page_size)
        self.index = PageIndex(self.pool)
        self.page_size = page_size
        self.enabled = enabled
        self.evictions = 0

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    def match(self, keys: list[PageKey]) -> np.ndarray:
        """Per key, the cached page with exactly that content (int64), or -1. It does not stop at a missing
        page: an evicted page leaves a hole and the pages after it still match."""
        if not self.enabled:
            return np.full(len(keys), -1, dtype=np.int64)
        return self.index.pages(keys)

    def available(self, exclude: list[int] = ()) -> int:
        """Pages a request could get now: free ones plus evictable cached ones not in `exclude`."""
        taken = list(map(self.pool.refcount.__getitem__, exclude)).count(1)
        return self.pool.num_free + self.index.evictable() - taken

    def acquire(self, pages: list[int]) -> list[int]:
        """Hold cached pages for a request (they become the most recently used)."""
        self.pool.incref(pages)
        self.index.touch(pages)
        return list(pages)

    def retire(self, pages: list[int]) -> None:
        """Cached pages a request found but does not read (an old stage, a dropped message): evict first."""
        self.index.touch(pages, dropped=True)

    def allocate_many(self, n: int) -> list[int]:
        """Up to n fresh pages: free ones first, then cached ones evicted (fewer only when nothing more can be
        had). The very pages, in the same order, that n allocations of one page would give (`PageIndex.evict`)."""
        pages = self.pool.allocate(min(n, self.pool.num_free))
        if len(pages) < n:
            evicted = self.index.evict(n - len(pages))
            self.evictions += len(evicted)
            pages += self.pool.allocate(len(evicted))
        return pages

    def publish(self, publish: dict[int, PageKey | None]) -> None:
        """Index complete pages (page -> key) that a running request still holds; the index takes its own
        reference, so they outlive the request. Publishing a page again only refreshes it."""
        offered = [(key, page) for page, key in publish.items() if key is not None]
        if self.enabled and offered:
            self.index.insert([k for k, _ in offered], [p for _, p in offered])

    def release(self, pages: list[int], publish: dict[int, PageKey | None]) -> None:
        """A request lets go of `pages`; those with a key in `publish` are complete and go to the index."""
        self.publish(publish)
        self.pool.decref(pages)

    def clear(self) -> None:
        """Forget every cached page (their KV is gone: the worker process died). Only pages no request holds
        can go, so end the requests first."""
        self.index.evict(len(self.index))
        if len(self.index):
            raise RuntimeError(f"{len(self.index)} cached pages are still held by requests")

    def check(self, holders: list[list[int]]) -> None:
        """Exact accounting: every reference is a running request's page or a cached page."""
        self.pool.check([*holders, self.index.held_pages()])

    def stats(self) -> dict:
        return {
            "pages_total": self.pool.num_pages,
            "pages_free": self.pool.num_free,
            "pages_cached": len(self.index),
            "pages_used": self.pool.num_used,
            "evictions": self.evictions,
        }
