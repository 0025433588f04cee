"""Resuming a plan where an earlier request's plan stopped, so an agent's next round plans only what is new.

An agent's round r + 1 resends round r's prompt, adds messages and extends its cache operations (they are
cumulative). Planning it from scratch walks every earlier reposition again: with a reposition per round
the plan holds every stage's copies, so planning would grow with the whole history. Instead the planner
leaves a snapshot of its state at its last cut point (a token index where a drop or reposition acts), and a
later plan that agrees with it on everything before that point starts there:

    round r      [ born | copies | born | copies | born ]                 snapshot before point n_r
    round r + 1  [ ------------- the same entries ------------- | copies | born ]   planned from n_r

"Agrees" is checked, not assumed: each cut point c gets a chain digest of everything the plan up to c
depends on (the token ids before c, which of them must be computed, and the events at every earlier cut),
and a snapshot is used only under an equal digest. A resumed plan is identical to one planned from
scratch (tests/test_cache_plan_memo.py checks that).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from minakv.cache.keys import PageKey


@dataclass
class Snapshot:
    """The planner's state right before the events at token index `point` (a cut point)."""

    point: int
    size: int  # entries planned so far
    digest: bytes  # events digest (records' first two words)
    current: np.ndarray  # [point]: each token's latest entry
    current_pos: np.ndarray  # [point]: that entry's position
    parts: list[tuple[np.ndarray, ...]]  # the entry columns so far, in blocks (shared, never written)
    blocks: list[tuple[int, int, int]]
    segment_keys: list[np.ndarray]
    segment_start: list[int]
    copies: int
    keys: list[PageKey]  # the keys of the full pages among the first `size` entries


def cut_digests(
    token_ids: np.ndarray, needed: np.ndarray, cuts: list[int], event_text: list[bytes]
) -> list[bytes]:
    """Per cut point cuts[i], the digest of what a plan up to it depends on: the chain of (the events at
    the cut before, the token ids and `needed` flags between the two)."""
    digests, prev, start = [], b"", 0
    for i, point in enumerate(cuts):
        text = event_text[i - 1] if i else b""
        h = hashlib.blake2b(prev + text, digest_size=16)
        h.update(token_ids[start:point].tobytes())
        h.update(needed[start:point].tobytes())
        prev, start = h.digest(), point
        digests.append(prev)
    return digests


class PlanMemo:
    """The latest snapshots, by cut digest; at most `max_entries` planned entries held in all (the
    snapshots of one agent share their arrays, so this overcounts)."""

    def __init__(self, page_size: int, max_entries: int = 4_000_000) -> None:
        self.page_size = page_size
        self.max_entries = max_entries
        self.snapshots: OrderedDict[bytes, Snapshot] = OrderedDict()
        self.entries = 0
        self.hits = 0

    def find(self, digests: list[bytes]) -> tuple[int, Snapshot] | None:
        """The latest cut i whose digest has a snapshot, and the snapshot."""
        for i in range(len(digests) - 1, 0, -1):
            snap = self.snapshots.get(digests[i])
            if snap is not None:
                self.snapshots.move_to_end(digests[i])
                self.hits += 1
                return i, snap
        return None

    def store(self, digest: bytes, snap: Snapshot) -> None:
        if digest in self.snapshots or snap.size > self.max_entries:
            return
        self.snapshots[digest] = snap
        self.entries += snap.size
        while self.entries > self.max_entries:
            _, old = self.snapshots.popitem(last=False)
            self.entries -= old.size
