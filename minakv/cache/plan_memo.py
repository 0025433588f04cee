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
    cost: int = 0  # entries of memory it keeps alive, counted when stored (PlanMemo.store)


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


class PlanMemo:
    """The latest snapshots, by cut digest; at most `max_entries` planned entries held in all (72 bytes
    each, up to twice that with the columns' spare room: ~100 MB at the default; the snapshots of one agent
    share their arrays, so this overcounts)."""

    def __init__(self, page_size: int, max_entries: int = 1_000_000) -> None:
        self.page_size = page_size
        self.max_entries = max_entries
        self.snapshots: OrderedDict[bytes, Snapshot] = OrderedDict()
        self.entries = 0
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
        """Keep `snap`, dropping the least recently used ones beyond the budget. A snapshot costs the
        capacity of the entry columns it keeps alive (not only the entries planned so far)."""
        snap.cost = max(snap.size, snap.columns.capacity)  # fixed now: the columns may grow later
        if digest in self.snapshots or snap.cost > self.max_entries:
            return
        self.snapshots[digest] = snap
        self.entries += snap.cost
        while self.entries > self.max_entries:
            _, old = self.snapshots.popitem(last=False)
            self.entries -= old.cost
