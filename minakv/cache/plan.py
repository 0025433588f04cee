"""Planning a request's KV entries from its compiled program.

The program (minakv.cache.program) says where every token sits and what every query sees. The plan turns
that into the physical work: which tokens to compute (the dependency closure: a token is computed only if
the last token, a token active at the end, or some other computed query reads it), which re-rotation
copies each reposition needs, the segment each computed token belongs to with the keys it sees from
outside its segment, and the record of every entry for cache keys.

    tokens   a0 a1 b0 b1 | c0 c1        drop {1: [0]}, reposition [1]
    entries  B(a0) B(a1) B(b0) B(b1) C(b0: 2->0) C(b1: 3->1) B(c0) B(c1)
    segments [ seg 0: a0..b1, no outside keys ] [ seg 1: c0..c1, outside keys = the two copies ]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from minakv.cache.keys import hash_parts, record  # record: the scheduler imports it from here too
from minakv.cache.program import NEVER, Program


@dataclass
class Entry:
    token_index: int  # index in the request's logical token sequence
    position: int  # position the key is rotated at
    segment: int = -1  # BORN entries: entries of one segment see the same outside keys; -1 for decode
    source: int | None = None  # COPY entries: the entry whose key is re-rotated into this one

    @property
    def is_copy(self) -> bool:
        return self.source is not None


@dataclass
class Plan:
    entries: list[Entry] = field(default_factory=list)
    records: list[bytes] = field(default_factory=list)  # one per entry, for page keys
    segment_keys: list[list[int]] = field(default_factory=list)  # per segment: outside entries it reads
    segment_start: list[int] = field(default_factory=list)  # per segment: its first entry
    last_entry: int = -1  # the entry of the last token: its logits give the next token
    final_keys: list[int] = field(default_factory=list)  # entries the first generated token reads
    final_digest: bytes = b""  # events so far, for records of decode entries
    num_skipped: int = 0  # tokens never computed because no query reads them
    num_copies: int = 0


def needed_tokens(program: Program, num_tokens: int) -> np.ndarray:
    """Boolean mask: must token t be computed? (Backward scan: t is needed if the last token, active at
    the end, or read by a needed query q with t < q < visible_until[t].)"""
    until = program.drop_points(np.arange(num_tokens))
    needed = np.zeros(num_tokens, dtype=bool)
    nearest = NEVER  # smallest needed index seen so far (all are > t)
    for t in range(num_tokens - 1, -1, -1):
        if t == num_tokens - 1 or until[t] == NEVER or nearest < until[t]:
            needed[t] = True
            nearest = t
    return needed


def _event_digest(prev: bytes, program: Program, point: int) -> bytes:
    ranges, repos = program.events_at(point)
    if not ranges and not repos:
        return prev
    text = f"@{point}:drop{ranges}:repos{repos}".encode()
    return hash_parts(prev, text)


def plan_request(program: Program, token_ids: list[int]) -> Plan:
    """Plan the entries for tokens [0, T) plus the events right before token T (the first to generate)."""
    n = len(token_ids)
    needed = needed_tokens(program, n)
    births = program.birth_positions(np.arange(n))
    cuts = set(program.drop_ranges) | {int(s) for s in program.stage_starts[1:]}
    plan = Plan(num_skipped=int((~needed).sum()))
    current: dict[int, int] = {}  # token -> its current entry (born, or latest copy)
    digest, segment, new_segment = b"", -1, True

    def add(entry: Entry, token: int) -> int:
        source_pos = plan.entries[entry.source].position if entry.source is not None else None
        plan.entries.append(entry)
        plan.records.append(record(digest, token_ids[token], entry, source_pos))
        current[token] = len(plan.entries) - 1
        return current[token]

    def enter(point: int) -> None:
        """Apply the events right before token `point`: drops change nothing physical; a reposition
        copies each computed survivor whose position changes into a fresh entry."""
        nonlocal digest, new_segment
        new_segment = True
        digest = _event_digest(digest, program, point)
        if point in program.stage_starts[1:]:
            stage = int(np.searchsorted(program.stage_starts, point))
            for rank, t in enumerate(program.survivors[stage].tolist()):
                old = plan.entries[current[t]] if t in current else None
                if old is not None and old.position != rank:
                    add(Entry(t, rank, source=current[t]), t)
                    plan.num_copies += 1

    for t in range(n):
        if t in cuts or t == 0:
            enter(t)
        if not needed[t]:
            continue
        if new_segment:  # the first computed token after a cut opens a segment
            new_segment = False
            segment = len(plan.segment_keys)
            keys, _ = program.active_before(t)
            plan.segment_keys.append([current[int(k)] for k in keys if int(k) in current])
            plan.segment_start.append(len(plan.entries))
        add(Entry(t, int(births[t]), segment=segment), t)
    plan.last_entry = current[n - 1]  # its born entry (a reposition right after may copy it)
    if n in cuts:
        enter(n)
    final = program.final_active.tolist() + list(range(program.num_tokens, n))
    plan.final_keys = [current[t] for t in final if t in current]
    plan.final_digest = digest
    return plan


def entries_to_compute(plan: Plan, have: list[bool]) -> list[int]:
    """Which entries to compute when the `have` ones are cached (docs/design.md 3.3): the last token's entry and
    those the first generated token reads, plus, transitively, everything a computed entry reads (its
    segment's outside keys and earlier members; a copy's source). Reads only go backwards, so one reverse
    pass settles it. An evicted entry nobody reads (typically a dropped one) is not recomputed."""
    needed = [False] * len(plan.entries)
    needed[plan.last_entry] = True
    for e in plan.final_keys:
        needed[e] = True
    reading: set[int] = set()  # segments with a computed member: their earlier members are read
    todo = []
    for e in range(len(plan.entries) - 1, -1, -1):
        entry = plan.entries[e]
        if entry.segment in reading and not entry.is_copy:
            needed[e] = True
        if not needed[e] or have[e]:
            continue
        todo.append(e)
        if entry.is_copy:
            needed[entry.source] = True
        elif entry.segment not in reading:
            reading.add(entry.segment)
            for k in plan.segment_keys[entry.segment]:
                needed[k] = True
    return todo[::-1]
