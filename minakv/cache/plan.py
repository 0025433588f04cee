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
    _final_pages: dict[int, np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    @property
    def size(self) -> int:
        return len(self.token)

    def final_pages(self, page_size: int) -> np.ndarray:
        """The pages (ascending) holding the entries the first generated token reads; computed once per plan
        and page size: a request asks every time it publishes."""
        if page_size not in self._final_pages:
            self._final_pages[page_size] = np.unique(self.final_keys // page_size)
        return self._final_pages[page_size]

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


class _Columns:
    """The entry columns (token, position, segment, source, records) in arrays with room to grow. A plan
    resumed from a snapshot appends to the columns in place when nothing was appended after the snapshot
    (an agent's next round after its last), so it costs what is new, not a copy of the whole history."""

    def __init__(self, capacity: int) -> None:
        self.cols = [np.empty(capacity, np.int64) for _ in range(4)] + [np.empty((capacity, 5), np.int64)]
        self.length = 0

    def claim(self, size: int) -> _Columns:
        """Columns to append to after entry `size`: these, unless someone appended past it already."""
        if self.length == size:
            return self
        other = _Columns(max(2 * size, 64))
        for mine, theirs in zip(other.cols, self.cols):
            mine[:size] = theirs[:size]
        other.length = size
        return other

    def append(self, *values: np.ndarray) -> None:
        n, k = self.length, len(values[0])
        if n + k > len(self.cols[0]):  # grow by doubling; plans holding views keep the old arrays
            bigger = _Columns(max(2 * (n + k), 64))
            for new, old in zip(bigger.cols, self.cols):
                new[:n] = old[:n]
            self.cols = bigger.cols
        for col, value in zip(self.cols, values):
            col[n : n + k] = value
        self.length = n + k

    @property
    def capacity(self) -> int:
        return len(self.cols[0])

    def view(self, size: int) -> list[np.ndarray]:
        return [col[:size] for col in self.cols]


class _Builder:
    """Appends blocks of entries; `current[t]` is token t's latest entry (born, or a copy), -1 if none."""

    def __init__(self, n: int, token_ids: np.ndarray) -> None:
        self.ids = token_ids
        self.columns = _Columns(max(2 * n, 64))
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
        self.columns.append(tokens, positions, np.full(k, segment, np.int64), sources, rows)
        self.current[tokens] = np.arange(self.size, self.size + k)
        self.current_pos[tokens] = positions
        self.size += k

    def snapshot(self, point: int, last_born: int, blocks, segment_keys, segment_start, copies) -> Snapshot:
        """The state after the events at `point` (keys are filled in once the plan's are known)."""
        return Snapshot(
            point, last_born, self.size, self.digest, self.current[:point].copy(),
            self.current_pos[:point].copy(), self.columns, list(blocks), list(segment_keys),
            list(segment_start), copies, [],
        )  # fmt: skip

    def resume(self, snap: Snapshot) -> None:
        self.columns, self.size, self.digest = snap.columns.claim(snap.size), snap.size, snap.digest
        self.current[: snap.point] = snap.current
        self.current_pos[: snap.point] = snap.current_pos


def plan_request(program: Program, token_ids: list[int], memo: PlanMemo | None = None) -> Plan:
    """Plan the entries for tokens [0, T) plus the events right before token T (the first to generate).
    With a memo, start from the latest snapshot of an earlier plan that agrees with this one up to its
    point, leave a snapshot after the events at this plan's last cut, and compute the page keys (`Plan.keys`)."""
    n = len(token_ids)
    ids = np.asarray(token_ids, dtype=np.int64)
    needed = needed_tokens(program, n)
    births = program.birth_positions(np.arange(n))
    stage_starts = set(program.stage_starts[1:].tolist())
    cuts = sorted(c for c in set(program.drop_ranges) | stage_starts | {0} if c <= n)
    texts = [_event_text(program, c) for c in cuts]
    b = _Builder(n, ids)
    blocks, segment_keys, segment_start, copies = [], [], [], 0
    # per cut, the digest of everything the plan depends on up to and including the events there
    digests = cut_digests(ids, needed, cuts, texts) if memo is not None else []
    found = memo.find(digests) if memo is not None else None
    resumed = found.point if found is not None else -1  # events at and before it are applied already
    if found is not None:
        b.resume(found)
        blocks, segment_keys = list(found.blocks), list(found.segment_keys)
        segment_start, copies = list(found.segment_start), found.copies

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

    snapshot, last_entry = None, -1
    for i, (point, end) in enumerate(zip(cuts, [*cuts[1:], n])):
        if point < resumed:
            continue
        if point == resumed:
            before = found.last_born
        else:  # token point - 1's entry before the events here (a reposition may copy it)
            before = int(b.current[point - 1]) if point > 0 else -1
            enter(point, texts[i])
        if point == n:
            last_entry = before  # the last token's logits come from its born entry
        if memo is not None and i == len(cuts) - 1 and point > 0:  # the last cut: leave a snapshot
            snapshot = b.snapshot(point, before, blocks, segment_keys, segment_start, copies)
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
    token, position, segment, source, records = b.columns.view(b.size)
    plan = Plan(
        token, position, segment, source, records, blocks, segment_keys, segment_start,
        last_entry, final_entries[final_entries >= 0], b.digest, int((~needed).sum()), copies,
    )  # fmt: skip
    if memo is not None:
        ps = memo.page_size
        known = found.keys if found is not None else []
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
