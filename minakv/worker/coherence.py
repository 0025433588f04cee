"""Which workers hold the current contents of each KV page: the parent's table that plans the transfers.

Every worker of the prefill and decode pools (the *holders*: prefill workers 0..N-1, then decode workers
N..N+M-1) allocates the same pool, and the scheduler's one page numbering means the same place on each. A
page's contents change only when a step writes it, on one worker; the table keeps a version per page
(bumped by every write) and the version each holder has:

    page          7     8     9     12
    version       3     1     5     2
    prefill 0     3     1     4     2        page 9: decode worker 0 wrote it last (a generated token)
    prefill 1     0     1     0     2        page 7: written by prefill worker 0, nobody else has it yet
    decode 0      1     1     5     2

Before a step, every page a worker reads or writes must be current there; those that are not are sent to it
first from a holder that has the current version (one always does), and are then current on both. So a page
moves only where it is lacking: a shared prefix, or an earlier round's pages, are sent to a worker once and
stay. A freshly allocated page holds nothing anyone reads, so it counts as current everywhere: writing it
costs no transfer.

The work is proportional to the pages a step touches, never to a request's history: arrays indexed by page.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PREFILL, DECODE = 0, 1  # the holders of a 1:1 pair


@dataclass
class Moves:
    """Pages, with the version each has (or must arrive with)."""

    pages: np.ndarray
    versions: np.ndarray

    def __len__(self) -> int:
        return len(self.pages)


@dataclass
class StepPlan:
    sends: dict[tuple[int, int], Moves]  # (source, destination) -> the pages it sends before the step
    written: list[Moves]  # per holder: the pages its part writes, with their new versions
    had: np.ndarray  # per holder: pages it only reads and held already (nothing sent)

    def received(self, holder: int) -> int:
        return sum(len(m) for (_, dst), m in self.sends.items() if dst == holder)


class Coherence:
    def __init__(self, num_pages: int, holders: int = 2) -> None:
        self.num_pages, self.holders = num_pages, holders
        self.clear()

    def clear(self) -> None:
        """Nothing is held anywhere (the workers restarted with empty pools)."""
        self.version = np.zeros(self.num_pages, dtype=np.int64)
        self.held = np.zeros((self.holders, self.num_pages), dtype=np.int64)

    def fresh(self, page: int) -> None:
        """`page` was just allocated: its old contents are garbage nobody reads, so every holder is current."""
        self.version[page] += 1
        self.held[:, page] = self.version[page]

    def lacking(self, holder: int, pages: np.ndarray) -> np.ndarray:
        """The `pages` whose current version `holder` does not have."""
        return pages[self.held[holder, pages] != self.version[pages]]

    def plan(self, reads: list[np.ndarray], writes: list[np.ndarray]) -> StepPlan:
        """The transfers a step needs (per holder: the sorted pages its part reads and writes), and the table
        after it. Raises if a page is written by one worker and touched by another in the same step: the
        batch was cut wrong (pages never change under a reader, docs/workers.md)."""
        n = self.holders
        needed = [np.union1d(reads[h], writes[h]) for h in range(n)]
        written = np.concatenate(writes)
        writer = np.repeat(np.arange(n), [len(w) for w in writes])
        for h in range(n):
            foreign = np.intersect1d(needed[h], written[writer != h])
            if len(foreign):
                raise RuntimeError(
                    f"pages {foreign[:8].tolist()} are written by another worker in the step worker {h} uses them"
                )
        sends: dict[tuple[int, int], Moves] = {}
        had = np.zeros(n, dtype=np.int64)
        for h in range(n):
            lacking = self.lacking(h, needed[h])
            current = self.held[:, lacking] == self.version[lacking]  # [holders, pages]
            stale = lacking[~current.any(axis=0)]
            if len(stale):  # a bug in the planning: nobody has the page's last write
                raise RuntimeError(f"pages {stale[:8].tolist()} are current on no worker")
            source = current.argmax(axis=0)  # the first holder that has each (deterministic)
            for src in np.unique(source):
                pages = lacking[source == src]
                sends[(int(src), h)] = Moves(pages, self.version[pages].copy())
            only_read = np.setdiff1d(reads[h], writes[h], assume_unique=True)
            had[h] = len(only_read) - len(np.intersect1d(only_read, lacking, assume_unique=True))
        for (_, dst), moves in sends.items():
            self.held[dst, moves.pages] = moves.versions
        new = []
        for h in range(n):
            pages = writes[h]
            self.version[pages] += 1
            self.held[h, pages] = self.version[pages]
            new.append(Moves(pages, self.version[pages].copy()))
        return StepPlan(dict(sorted(sends.items())), new, had)
