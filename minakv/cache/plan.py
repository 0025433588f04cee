"""Planning a request's KV entries from its compiled program.

The program (minakv.cache.program) says where every token sits and what every query sees. The plan turns
that into the physical work: which tokens to compute (the dependency closure: a token is computed only if
the last token, a token active at the end, or some other computed query reads it), which re-rotation
copies each reposition needs, the segment each computed token belongs to with the keys it sees from
outside its segment, and the record of every entry for cache keys.

    tokens   a0 a1 b0 b1 | c0 c1        drop {1: [0]}, reposition [1]
    entries  B(a0) B(a1) B(b0) B(b1) C(b0: 2->0) C(b1: 3->1) B(c0) B(c1)
    segments [ seg 0: a0..b1, no outside keys ] [ seg 1: c0..c1, outside keys = the two copies ]

The plan is a set of numpy arrays, one row per entry, built a block at a time (a run of born entries between
two cut points, or the copies of one reposition), so planning a long agent history costs a few numpy
passes per drop or reposition point, not Python work per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from minakv.cache.keys import PageKey, digest_words, hash_parts, page_keys
from minakv.cache.plan_memo import PlanMemo, Snapshot, cut_digests
from minakv.cache.program import NEVER, Program


@dataclass
class Entry:
    """One entry, as a readable record (tests and docs; the engine reads the plan's arrays)."""

    token_index: int  # index in the request's logical token sequence
    position: int  # position the key is rotated at
    segment: int = -1  # BORN entries: entries of one segment see the same outside keys; -1 for decode
    source: int | None = None  # COPY entries: the entry whose key is re-rotated into this one

    @property
    def is_copy(self) -> bool:
        return self.source is not None


@dataclass
class Plan:
    token: np.ndarray  # int64 [E]: each entry's token index
    position: np.ndarray  # int64 [E]: the position its key is rotated at
    segment: np.ndarray  # int64 [E]: born entries' segment, -1 for copies
    source: np.ndarray  # int64 [E]: copies' source entry, -1 for born entries
    records: np.ndarray  # int64 [E, 5]: what each entry holds, for page keys (minakv/cache/keys.py)
    blocks: list[tuple[int, int, int]]  # (first, end, segment or -1 for a copy block), in entry order
    segment_keys: list[np.ndarray] = field(default_factory=list)  # per segment: outside entries it reads
    segment_start: list[int] = field(default_factory=list)  # per segment: its first entry
    last_entry: int = -1  # the entry of the last token: its logits give the next token
    final_keys: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # the first token's keys
    final_digest: bytes = b""  # events so far, for records of decode entries
    num_skipped: int = 0  # tokens never computed because no query reads them
    num_copies: int = 0
    keys: list[PageKey] | None = None  # page keys, when planned with a memo (it knows the page size)

    @property
    def size(self) -> int:
        return len(self.token)

    @cached_property
    def entries(self) -> list[Entry]:
        return [
            Entry(int(t), int(p), int(g), None if s < 0 else int(s))
            for t, p, g, s in zip(self.token, self.position, self.segment, self.source)
        ]


def needed_tokens(program: Program, num_tokens: int) -> np.ndarray:
    """Boolean mask: must token t be computed? It is if it is the last token, active at the end, or read by
    a needed query q with t < q < visible_until[t]. A run of dropped tokens that leave attention at the
    same point shares one answer (each is read by the next one, itself inside the window), so the runs are
    decided from the last one back, each by the nearest needed token after it: one step per run."""
    until = program.drop_points(np.arange(num_tokens))
    needed = until == NEVER
    needed[num_tokens - 1] = True
    always = np.nonzero(needed)[0]
    dropped = np.nonzero(~needed)[0]
    if not len(dropped):
        return needed
    breaks = np.nonzero((np.diff(dropped) != 1) | (np.diff(until[dropped]) != 0))[0] + 1
    nearest = NEVER  # the first token of the latest run found needed (runs are visited backwards)
    for run in reversed(np.split(dropped, breaks)):
        last = int(run[-1])
        k = int(np.searchsorted(always, last, side="right"))
        after = min(int(always[k]) if k < len(always) else NEVER, nearest)
        if after < until[last]:
            needed[run] = True
            nearest = int(run[0])
    return needed


def _event_text(program: Program, point: int) -> bytes:
    """The events just before token `point`, as bytes for digests (empty if none)."""
    ranges, repos = program.events_at(point)
    return f"@{point}:drop{ranges}:repos{repos}".encode() if ranges or repos else b""


class _Builder:
    """Appends blocks of entries; `current[t]` is token t's latest entry (born, or a copy), -1 if none."""

    def __init__(self, n: int, token_ids: np.ndarray) -> None:
        self.ids = token_ids
        self.parts: list[tuple[np.ndarray, ...]] = []
        self.size = 0
        self.current = np.full(n, -1, dtype=np.int64)
        self.current_pos = np.zeros(n, dtype=np.int64)
        self.digest = b""

    def add(self, tokens: np.ndarray, positions: np.ndarray, segment: int, sources: np.ndarray) -> None:
        k = len(tokens)
        src_pos = np.where(sources >= 0, self.current_pos[tokens], -1) if segment < 0 else np.full(k, -1)
        rows = np.empty((k, 5), dtype=np.int64)
        rows[:, :2] = digest_words(self.digest)
        rows[:, 2], rows[:, 3], rows[:, 4] = self.ids[tokens], positions, src_pos
        self.parts.append((tokens, positions, np.full(k, segment, np.int64), sources, rows))
        self.current[tokens] = np.arange(self.size, self.size + k)
        self.current_pos[tokens] = positions
        self.size += k

    def snapshot(self, point: int, blocks, segment_keys, segment_start, copies: int) -> Snapshot:
        """The state before the events at `point` (keys are filled in once the plan's are known)."""
        return Snapshot(
            point, self.size, self.digest, self.current[:point].copy(), self.current_pos[:point].copy(),
            list(self.parts), list(blocks), list(segment_keys), list(segment_start), copies, [],
        )  # fmt: skip

    def resume(self, snap: Snapshot) -> None:
        self.parts, self.size, self.digest = list(snap.parts), snap.size, snap.digest
        self.current[: snap.point] = snap.current
        self.current_pos[: snap.point] = snap.current_pos


def plan_request(program: Program, token_ids: list[int], memo: PlanMemo | None = None) -> Plan:
    """Plan the entries for tokens [0, T) plus the events right before token T (the first to generate).
    With a memo, start from the latest snapshot of an earlier plan that agrees with this one up to its
    point, leave a snapshot at this plan's last cut, and compute the page keys (`Plan.keys`)."""
    n = len(token_ids)
    ids = np.asarray(token_ids, dtype=np.int64)
    needed = needed_tokens(program, n)
    births = program.birth_positions(np.arange(n))
    stage_starts = set(program.stage_starts[1:].tolist())
    cuts = sorted(c for c in set(program.drop_ranges) | stage_starts | {0} if c <= n)
    texts = [_event_text(program, c) for c in cuts]
    b = _Builder(n, ids)
    blocks, segment_keys, segment_start, copies = [], [], [], 0
    digests = cut_digests(ids, needed, cuts, texts) if memo is not None else []
    found = memo.find(digests) if memo is not None else None
    if found is not None:
        snap = found[1]
        b.resume(snap)
        blocks, segment_keys, segment_start = (
            list(snap.blocks),
            list(snap.segment_keys),
            list(snap.segment_start),
        )
        copies = snap.copies

    def enter(point: int, text: bytes) -> None:
        """Apply the events right before token `point`: drops change nothing physical; a reposition
        copies each computed survivor whose position changes into a fresh entry."""
        nonlocal copies
        b.digest = hash_parts(b.digest, text) if text else b.digest
        if point in stage_starts:
            stage = int(np.searchsorted(program.stage_starts, point))
            survivors = program.survivors[stage]
            ranks = np.arange(len(survivors), dtype=np.int64)
            moved = (b.current[survivors] >= 0) & (b.current_pos[survivors] != ranks)
            if moved.any():
                first = b.size
                b.add(survivors[moved], ranks[moved], -1, b.current[survivors[moved]])
                blocks.append((first, b.size, -1))
                copies += int(moved.sum())

    snapshot = None
    for i, (point, end) in enumerate(zip(cuts, [*cuts[1:], n])):
        if found is not None and point < found[1].point:
            continue
        if memo is not None and i == len(cuts) - 1 and point > 0:  # the last cut: leave a snapshot
            snapshot = b.snapshot(point, blocks, segment_keys, segment_start, copies)
        if point == n:  # the last token's born entry, before a reposition right after it copies it
            last_entry = int(b.current[n - 1])
        enter(point, texts[i])
        if point >= n:
            break
        born = np.nonzero(needed[point:end])[0] + point
        if not len(born):
            continue
        keys, _ = program.active_before(int(born[0]))  # the segment's outside keys, at its first query
        entries = b.current[keys]
        segment_keys.append(entries[entries >= 0])
        segment_start.append(b.size)
        first = b.size
        b.add(born, births[born], len(segment_keys) - 1, np.full(len(born), -1, np.int64))
        blocks.append((first, b.size, len(segment_keys) - 1))
    if cuts[-1] < n:
        last_entry = int(b.current[n - 1])
    final = np.concatenate([program.final_active, np.arange(program.num_tokens, n, dtype=np.int64)])
    final_entries = b.current[final]
    columns = [np.concatenate(c) for c in zip(*b.parts)] if b.parts else [np.zeros(0, np.int64)] * 5
    token, position, segment, source, records = columns
    plan = Plan(
        token, position, segment, source, records.reshape(-1, 5), blocks, segment_keys, segment_start,
        last_entry, final_entries[final_entries >= 0], b.digest, int((~needed).sum()), copies,
    )  # fmt: skip
    if memo is not None:
        ps = memo.page_size
        known = found[1].keys if found is not None else []
        parent = known[-1].key if known else None
        plan.keys = known + page_keys(plan.records[len(known) * ps :], ps, parent=parent)
        if snapshot is not None:
            snapshot.keys = plan.keys[: snapshot.size // ps]
            memo.store(digests[-1], snapshot)
    return plan


def entries_to_compute(plan: Plan, have: np.ndarray) -> np.ndarray:
    """Which entries to compute when the `have` ones are cached (docs/design.md 3.3); see `closure`."""
    return closure(plan, have)[0]


def closure(plan: Plan, have: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(entries to compute, entries read) when the `have` ones are cached: the last token's entry and those
    the first generated token reads, plus, transitively, everything a computed entry reads (its segment's
    outside keys and earlier members; a copy's source). Reads only go backwards, so one reverse pass over
    the blocks settles it. An evicted entry nobody reads (typically a dropped one, or a key superseded by
    a later reposition's copy) is not recomputed, and a cached one nobody reads need not be held."""
    have = np.asarray(have, dtype=bool)
    needed = np.zeros(plan.size, dtype=bool)
    needed[plan.last_entry] = True
    needed[plan.final_keys] = True
    todo = []
    for first, end, segment in reversed(plan.blocks):
        missing = needed[first:end] & ~have[first:end]
        if not missing.any():
            continue
        if segment < 0:  # copies read their sources
            chosen = np.nonzero(missing)[0] + first
            needed[plan.source[chosen]] = True
        else:  # a computed member reads the segment's outside keys and every earlier member
            last = first + int(np.nonzero(missing)[0][-1])
            chosen = np.nonzero(~have[first : last + 1])[0] + first
            needed[first : last + 1] = True
            needed[plan.segment_keys[segment]] = True
        todo.append(chosen)
    return (np.concatenate(todo[::-1]) if todo else np.zeros(0, np.int64)), needed
