"""Which worker holds the current contents of each KV page: the parent's table that plans the transfers.

Both workers allocate the same pool, and the scheduler's one page numbering means the same place on both
sides. A page's contents change only when a step writes it, on one side; the table keeps a version per page
(bumped by every write) and the version each side holds:

    page        7     8     9     12
    version     3     1     5     2
    prefill     3     1     4     2        page 9: the decode side wrote it last (a generated token)
    decode      1     1     5     2        page 7: written by a prefill, not sent yet

Before a step, every page a side reads or writes must be current there; those that are not are sent from
the other side first (one of the two always holds it), and are then current on both. So a page moves only
when a side lacks it: a shared prefix, or an earlier round's pages, are sent once and stay. A freshly
allocated page holds nothing anyone reads, so it counts as current on both: writing it costs no transfer.

The work is proportional to the pages a step touches, never to a request's history: arrays indexed by page.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PREFILL, DECODE = 0, 1
SIDES = ("prefill", "decode")


@dataclass
class Moves:
    """Pages to send from one side to the other before a step, with the version each must arrive with."""

    pages: np.ndarray
    versions: np.ndarray

    def __len__(self) -> int:
        return len(self.pages)


@dataclass
class StepPlan:
    to_decode: Moves  # prefill -> decode, before the step
    to_prefill: Moves  # decode -> prefill, before the step
    written: tuple[Moves, Moves]  # per side: the pages its part writes, with their new versions
    decode_held: int  # pages the decode side reads that it held already (not sent)


class Coherence:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.clear()

    def clear(self) -> None:
        """Nothing is held anywhere (the workers restarted with empty pools)."""
        self.version = np.zeros(self.num_pages, dtype=np.int64)
        self.held = np.zeros((2, self.num_pages), dtype=np.int64)

    def fresh(self, page: int) -> None:
        """`page` was just allocated: its old contents are garbage nobody reads, so both sides are current."""
        self.version[page] += 1
        self.held[:, page] = self.version[page]

    def plan(self, reads: tuple[np.ndarray, np.ndarray], writes: tuple[np.ndarray, np.ndarray]) -> StepPlan:
        """The transfers a step needs (per side: the pages its part reads and writes), and the table after it."""
        both = np.intersect1d(writes[PREFILL], writes[DECODE], assume_unique=True)
        if len(both):
            raise RuntimeError(f"pages {both[:8].tolist()} are written by both workers in one step")
        moves = []
        for side in (PREFILL, DECODE):
            needed = np.union1d(reads[side], writes[side])
            lacking = needed[self.held[side, needed] != self.version[needed]]
            other = 1 - side
            stale = lacking[self.held[other, lacking] != self.version[lacking]]
            if len(stale):  # a bug in the planning: nobody holds the page's last write
                raise RuntimeError(f"pages {stale[:8].tolist()} are current on neither worker")
            moves.append(Moves(lacking, self.version[lacking].copy()))
        if len(np.intersect1d(moves[PREFILL].pages, writes[DECODE])) or len(
            np.intersect1d(moves[DECODE].pages, writes[PREFILL])
        ):
            raise RuntimeError("a page is sent to one worker while the other writes it")
        reads_only = np.setdiff1d(reads[DECODE], writes[DECODE], assume_unique=True)
        decode_held = len(reads_only) - len(
            np.intersect1d(reads_only, moves[DECODE].pages, assume_unique=True)
        )
        for side in (PREFILL, DECODE):
            self.held[side, moves[side].pages] = moves[side].versions
        written = []
        for side in (PREFILL, DECODE):
            pages = writes[side]
            self.version[pages] += 1
            self.held[side, pages] = self.version[pages]
            written.append(Moves(pages, self.version[pages].copy()))
        return StepPlan(moves[DECODE], moves[PREFILL], (written[0], written[1]), decode_held)
