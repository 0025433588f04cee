"""The paged KV pool: which pages are free, and how many holders each used page has.

Only bookkeeping lives here; the K/V tensors live in the worker (`k_cache[layer, slot, head, dim]`, page p
= slots [p * page_size, (p + 1) * page_size)). A page is held by running requests (their page tables) and
by the index of cached states (one reference while it is indexed). A page returns to the free list when
its last holder lets go, never earlier:

    allocate(n) -> n pages, refcount 1      incref(pages): one more holder
    decref(pages): one holder fewer; pages reaching 0 are free again (returned)

`check(holders)` verifies the invariants against the holders' own view of what they hold.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

import numpy as np


class PoolExhausted(MemoryError):
    """Not enough free pages (evict cached pages or preempt a request, then retry)."""


class PoolError(RuntimeError):
    """A bookkeeping error: a holder let go of a page it does not hold, or the invariants broke."""


class PagePool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self.refcount = [0] * num_pages
        self.free: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self.free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise PoolExhausted(f"need {n} pages, {len(self.free)} free of {self.num_pages}")
        pages = [self.free.popleft() for _ in range(n)]
        for p in pages:
            self.refcount[p] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        for p in pages:
            if self.refcount[p] <= 0:
                raise PoolError(f"incref of free page {p}")
            self.refcount[p] += 1

    def decref(self, pages: Iterable[int]) -> list[int]:
        """Drop one reference from each page; returns the pages that became free."""
        freed = []
        for p in pages:
            if self.refcount[p] <= 0:
                raise PoolError(f"decref of free page {p}")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self.free.append(p)
                freed.append(p)
        return freed

    def slots(self, pages: Iterable[int]) -> np.ndarray:
        """The slot indices of the pages, in order (a page table flattened)."""
        pages = np.asarray(list(pages), dtype=np.int64)
        return (pages[:, None] * self.page_size + np.arange(self.page_size)[None, :]).reshape(-1)

    def check(self, holders: Iterable[Iterable[int]]) -> None:
        """Raise PoolError unless: free + used == total, no page is both free and referenced, the free list
        has no duplicates, and every refcount equals the number of times the holders hold the page."""
        held = Counter(p for pages in holders for p in pages)
        free = set(self.free)
        problems = []
        if len(free) != len(self.free):
            problems.append("the free list has duplicates")
        used = sum(1 for c in self.refcount if c > 0)
        if len(free) + used != self.num_pages:
            problems.append(f"free {len(free)} + used {used} != total {self.num_pages}")
        for p in range(self.num_pages):
            if p in free and self.refcount[p] != 0:
                problems.append(f"page {p} is free with refcount {self.refcount[p]}")
            if self.refcount[p] != held.get(p, 0):
                problems.append(f"page {p} has refcount {self.refcount[p]} but {held.get(p, 0)} holders")
        if problems:
            raise PoolError("; ".join(problems[:10]))
