"""Resuming a plan where an earlier request's plan stopped, so an agent's next round plans only what is new.

An agent's round r + 1 resends round r's prompt, adds messages and extends its cache operations (they are
cumulative). Planning it from scratch walks every earlier reposition again: with a reposition per round
the plan holds every stage's copies, so planning would grow with the whole history. Instead the planner
leaves a snapshot of its state after its last cut point (a token index where a drop or reposition acts),
and a later plan that agrees with it on everything up to that point starts there:

    round r      [ born | copies | born | copies | born | copies ]          snapshot after point n_r
    round r + 1  [ ---------------- the same entries ---------------- | born | copies ]   planned from n_r

"Agrees" is checked, not assumed: each cut point c gets a chain digest of everything the plan up to c
depends on (the token ids before c, which of them must be computed, and the events at c and every earlier
cut), and a snapshot is used only under an equal digest. When nothing was planned after the snapshot (the
prompt ended at that cut, as an agent's round ends with its tool result), the next plan appends to the same
entry columns in place instead of copying the history. A resumed plan is identical to one planned from
scratch (tests/test_cache_plan_memo.py checks that).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from minakv.cache.keys import PageKey


@dataclass
class Snapshot:
    """The planner's state right after the events at token index `point` (a cut point)."""

    point: int
    last_born: int  # token point - 1's entry before those events (the last token's, if point ends a prompt)
    size: int  # entries planned so far
    digest: bytes  # events digest (records' first two words)
    current: np.ndarray  # [point]: each token's latest entry
    current_pos: np.ndarray  # [point]: that entry's position
    columns: Any  # plan.py's growable entry columns, holding at least `size` entries
    blocks: list[tuple[int, int, int]]
    segment_keys: list[np.ndarray]
    segment_start: list[int]
    copies: int
    keys: list[PageKey]  # the keys of the full pages among the first `size` entries


def cut_digests(
    token_ids: np.ndarray, needed: np.ndarray, cuts: list[int], events: list[bytes]
) -> list[bytes]:
    """Per cut point cuts[i], the digest of everything a plan up to it depends on: a chain over the cuts of
    the token ids since the cut before, which of them are computed, and the events at the cut."""
    digests, prev, start = [], b"", 0
    for point, text in zip(cuts, events):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(token_ids[start:point].tobytes())
        h.update(needed[start:point].tobytes())
        h.update(text)
        prev, start = h.digest(), point
        digests.append(prev)
    return digests


ENTRY_BYTES = 72  # one planned entry in the columns: token, position, segment, source, 5-word record


class PlanMemo:
    """The latest snapshots, by cut digest, within `max_bytes` of memory (LRU).

    An agent's successive snapshots share one set of entry columns (each round appends to it in place), so
    the columns are counted once, at their capacity, however many snapshots hold them; each snapshot adds
    its own per-token arrays. Counting the columns per snapshot would make 8 agents of 24 rounds overflow
    any sane budget and evict exactly the snapshots their next rounds need."""

    def __init__(self, page_size: int, max_bytes: int = 1 << 30) -> None:
        self.page_size = page_size
        self.max_bytes = max_bytes
        self.snapshots: OrderedDict[bytes, Snapshot] = OrderedDict()
        self.columns: dict[int, list] = {}  # id -> [columns, snapshots holding them, capacity counted]
        self.bytes = 0
        self.hits = 0

    def find(self, digests: list[bytes]) -> Snapshot | None:
        """The snapshot at the latest cut whose digest has one."""
        for digest in reversed(digests[1:]):
            snap = self.snapshots.get(digest)
            if snap is not None:
                self.snapshots.move_to_end(digest)
                self.hits += 1
                return snap
        return None

    def store(self, digest: bytes, snap: Snapshot) -> None:
        """Keep `snap`, dropping the least recently used snapshots while the memo is over its budget."""
        if digest in self.snapshots:
            return
        self.snapshots[digest] = snap
        held = self.columns.setdefault(id(snap.columns), [snap.columns, 0, 0])
        held[1] += 1
        grown = snap.columns.capacity - held[2]  # the columns may have grown since a snapshot counted them
        held[2] += grown
        self.bytes += ENTRY_BYTES * grown + own_bytes(snap)
        while self.bytes > self.max_bytes and self.snapshots:
            _, old = self.snapshots.popitem(last=False)
            self.bytes -= own_bytes(old)
            held = self.columns[id(old.columns)]
            held[1] -= 1
            if held[1] == 0:
                self.bytes -= ENTRY_BYTES * held[2]
                del self.columns[id(old.columns)]


def own_bytes(snap: Snapshot) -> int:
    """A snapshot's own arrays (the columns are shared and counted apart)."""
    return snap.current.nbytes + snap.current_pos.nbytes
