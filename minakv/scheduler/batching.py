"""How a request's next work becomes rows of the step's `ForwardBatch` (minakv/worker/batch.py).

The scheduler decides *which* requests run in a step (scheduler.py); these functions write *what* each one
contributes, in the layout the worker reads:

    decode   one query per request: its last sampled token (or a reference to it, still on the device),
             its slot and position, and its key-table row (all of its active keys the first time, then one
             new key per step: per-step work does not grow with the history)
    prefill  re-rotation copies first, then runs of consecutive entries of one segment ("pieces"), each
             with the segment's outside keys; the plan's last entry is sampled
    masks    structured outputs: one bitmask row per constrained sample row

Entries become pool slots through the request's pages: slot = page * page_size + offset.
"""

from __future__ import annotations

import numpy as np

from minakv.grammar import fill_masks
from minakv.scheduler.request import Request
from minakv.worker.batch import ForwardBatch


def add_masks(batch: ForwardBatch) -> None:
    """Structured outputs: the tokens each constrained row may sample, as one bitmask for the step. Built
    here, on the host, while the device still runs the step before; the matchers are up to date, since
    a request with a grammar is never scheduled with a token still on the device."""
    batch.mask_rows = [i for i, r in enumerate(batch.scheduled) if r.grammar is not None]
    if batch.mask_rows:
        batch.token_mask = fill_masks([batch.scheduled[i].grammar for i in batch.mask_rows])


def add_decode(
    batch: ForwardBatch, r: Request, page_size: int, rows: list[int], penalty_rows: list[int], split: bool
) -> None:
    """Feed r's last sampled token: one new entry at the next position, reading all active keys. `rows`
    and `penalty_rows`: the free rows of the worker's key and penalty tables (r takes one of each the
    first time); `split`: separate prefill and decode workers (r's penalty row is refilled on the decode
    side at its first decode step)."""
    t = r.num_tokens + r.pending - 1
    e = r.num_entries
    r.decode_tokens.append(t)
    r.decode_positions.append(r.next_pos)
    slot = slot_of(r, e, page_size)
    if r.row < 0:  # first decode step since (re)admission: the row gets all keys at once
        r.row = rows.pop()
        keys = r.plan.final_keys  # the keys the plan leaves live (no decode entry yet since planning)
        batch.write_row(r.row, 0, slots_of(r, page_size, keys), r.plan.position[keys])
        r.row_len = len(keys)
        if split and r.penalty_row >= 0:  # counted on the prefill worker so far
            batch.penalty_resets.append((r.penalty_row, r.prompt_ids, r.output_ids.tolist()))
    # the new key's table write follows from the columns below (ForwardBatch.decode_key_writes)
    r.row_len += 1
    # the input: a known token, or the one the previous step samples for r (still on the device)
    batch.input_ids.append(r.token_at(t) if r.pending == 0 else -(r.sample_row + 1))
    batch.positions.append(r.next_pos)
    batch.slots.append(slot)
    batch.decode_rows.append(r.row)
    batch.decode_lens.append(r.row_len)
    batch.num_decode += 1
    r.next_pos += 1
    sample_last(batch, r, penalty_rows)


def add_prefill(
    batch: ForwardBatch, r: Request, page_size: int, budget: int, penalty_rows: list[int]
) -> tuple[int, int]:
    """r's next entries to compute: copies first (re-rotations run before the forward, all at once, so
    none may read another of the same step), then computed tokens up to the budget, stopping before the
    next copy (its source may be computed in this very batch). A piece of queries is a run of consecutive
    entries of one segment; cached entries between them (a restore around holes) split pieces. Returns
    (new cursor, tokens computed)."""
    plan, todo, i = r.plan, r.todo, r.cursor
    is_copy = plan.source[todo[i:]] >= 0
    copies = todo[i : i + (int(np.argmin(is_copy)) if not is_copy.all() else len(is_copy))]
    chained = np.nonzero(np.isin(plan.source[copies], copies))[0]
    if len(chained):  # a copy of a copy made in this very call: the copies run at once, so wait a step
        copies = copies[: chained[0]]
    if len(copies):
        sources = plan.source[copies]
        values = (
            slots_of(r, page_size, sources),
            slots_of(r, page_size, copies),
            plan.position[sources],
            plan.position[copies],
        )
        for column, value in zip(batch.rerotate, values):
            column.append(value)
        r.usage.repos_tokens += len(copies)
        i += len(copies)
    run = todo[i : i + budget]
    copy_at = np.nonzero(plan.source[run] >= 0)[0]
    run = run[: copy_at[0]] if len(copy_at) else run
    breaks = np.nonzero((np.diff(run) != 1) | (np.diff(plan.segment[run]) != 0))[0] + 1
    for piece in np.split(run, breaks) if len(run) else []:
        first, seg = int(piece[0]), int(plan.segment[piece[0]])
        batch.input_ids += plan.records[piece, 2].tolist()
        batch.positions += plan.position[piece].tolist()
        batch.slots += slots_of(r, page_size, piece).tolist()
        # the segment's outside keys, plus its members before this piece (cached or computed earlier)
        outside = np.concatenate([plan.segment_keys[seg], np.arange(plan.segment_start[seg], first)])
        batch.add_segment_keys(slots_of(r, page_size, outside), plan.position[outside])
        batch.seg_q_indptr.append(batch.num_tokens - batch.num_decode)
        if piece[-1] == plan.last_entry:
            sample_last(batch, r, penalty_rows)
    return i + len(run), len(run)


def sample_last(batch: ForwardBatch, r: Request, penalty_rows: list[int]) -> None:
    """r's last token in the batch is sampled: its sample row, settings and (first time) penalty row."""
    r.sample_row = len(batch.sample_rows)
    batch.sample_rows.append(batch.num_tokens - 1)
    batch.sample_params.append(r.params)
    batch.sample_seeds.append(r.seed)
    batch.sample_counters.append(len(r.output_ids) + r.pending)
    if r.params.penalized and r.penalty_row < 0:  # first sample since (re)admission: fill its row
        r.penalty_row = penalty_rows.pop()
        batch.penalty_resets.append((r.penalty_row, r.prompt_ids, r.output_ids.tolist()))
    batch.sample_penalty_rows.append(r.penalty_row)
    batch.scheduled.append(r)
    r.pending += 1


def slot_of(r: Request, entry: int, page_size: int) -> int:
    """The pool slot of r's entry: its page's slot base plus the offset in the page."""
    return int(r.pages[entry // page_size]) * page_size + entry % page_size


def slots_of(r: Request, page_size: int, entries: np.ndarray) -> np.ndarray:
    # r.pages is an int64 array (admission makes it one), so there is nothing to convert per call
    return r.pages[entries // page_size] * page_size + entries % page_size
