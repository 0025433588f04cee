"""One step's `ForwardBatch` cut into the prefill worker's part and the decode worker's part.

The scheduler builds one batch per step, decode queries first, then prefill segments (minakv/worker/batch.py).
With separate workers (docs/workers.md) the decode queries, the key-table writes and their sample rows go to
the decode worker; the segments, the re-rotation copies and their sample rows to the prefill worker:

    batch      [d0 d1 d2 | s0 s0 s0 s1 s1]      decode tokens, then two segments
    samples    [d0 d1 d2 | s0-last s1-last]     sample rows follow the same order (decodes first)
    decode     [d0 d1 d2]                       samples 0..2, table writes
    prefill    [s0 s0 s0 s1 s1]                 samples 3..4 as 0..1, copies, segment keys

So the step's tokens are the decode part's followed by the prefill part's, in the batch's sample-row order.
Inputs that reference the previous step's samples (`-(j + 1)`) stay as they are: the decode worker's view of
the previous step's samples is its own followed by the prefill worker's (minakv/worker/transfer.py).
"""

from __future__ import annotations

import numpy as np

from minakv.worker.batch import ForwardBatch


def split_batch(batch: ForwardBatch) -> tuple[ForwardBatch | None, ForwardBatch | None]:
    """(prefill part, decode part); a part with nothing to do is None. The scheduler's note (`scheduled`)
    stays behind: the workers never read it, and it holds the requests."""
    nd = batch.num_decode
    k = sum(1 for row in batch.sample_rows if row < nd)  # decode sample rows come first
    if batch.sample_rows[:k] != sorted(batch.sample_rows[:k]) or any(r < nd for r in batch.sample_rows[k:]):
        raise ValueError("decode sample rows must precede the prefill ones")
    d_pen, p_pen = batch.sample_penalty_rows[:k], batch.sample_penalty_rows[k:]
    decode_rows = set(d_pen)
    d_resets = [x for x in batch.penalty_resets if x[0] in decode_rows]
    p_resets = [x for x in batch.penalty_resets if x[0] not in decode_rows]
    mask = np.asarray(batch.mask_rows, dtype=np.int64)
    d_mask, p_mask = mask[mask < k], mask[mask >= k]

    decode = ForwardBatch(
        input_ids=batch.input_ids[:nd],
        positions=batch.positions[:nd],
        slots=batch.slots[:nd],
        num_decode=nd,
        decode_rows=batch.decode_rows,
        decode_lens=batch.decode_lens,
        table_writes=batch.table_writes,
        sample_rows=batch.sample_rows[:k],
        sample_params=batch.sample_params[:k],
        sample_seeds=batch.sample_seeds[:k],
        sample_counters=batch.sample_counters[:k],
        sample_penalty_rows=d_pen,
        penalty_resets=d_resets,
        mask_rows=d_mask.tolist(),
        token_mask=batch.token_mask[: len(d_mask)] if len(d_mask) else None,
    )
    prefill = ForwardBatch(
        input_ids=batch.input_ids[nd:],
        positions=batch.positions[nd:],
        slots=batch.slots[nd:],
        seg_q_indptr=batch.seg_q_indptr,  # already counted from the first prefill token
        seg_kv_indptr=batch.seg_kv_indptr,
        seg_kv_slots=batch.seg_kv_slots,
        seg_kv_pos=batch.seg_kv_pos,
        rerotate=batch.rerotate,
        sample_rows=[row - nd for row in batch.sample_rows[k:]],
        sample_params=batch.sample_params[k:],
        sample_seeds=batch.sample_seeds[k:],
        sample_counters=batch.sample_counters[k:],
        sample_penalty_rows=p_pen,
        penalty_resets=p_resets,
        mask_rows=(p_mask - k).tolist(),
        token_mask=batch.token_mask[len(d_mask) :] if len(p_mask) else None,
    )
    return (prefill if _busy(prefill) else None), (decode if _busy(decode) else None)


def _busy(part: ForwardBatch) -> bool:
    return bool(part.num_tokens or part.num_copies or part.table_writes[0] or part.penalty_resets)


def pages_of(chunks: list, page_size: int) -> np.ndarray:
    """The distinct pages of the slots in `chunks` (lists or arrays of slots), sorted."""
    parts = [np.asarray(c, dtype=np.int64) for c in chunks if len(c)]
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return np.unique(np.concatenate(parts) // page_size)


def reads_and_writes(
    prefill: ForwardBatch | None, decode: ForwardBatch | None, page_size: int
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Per side, the pages its part reads and the pages it writes. The prefill side reads its segments' keys
    and its copies' sources, and writes its tokens' slots and its copies' destinations; the decode side reads
    the keys written into its key table (a whole row when a request starts decoding, then one key a step)
    and writes its tokens' slots. Keys already in a table row are not read again here: a decoding request's
    pages never change on the other side (docs/workers.md)."""
    empty = np.zeros(0, dtype=np.int64)
    p = (empty, empty)
    if prefill is not None:
        p = (
            pages_of([*prefill.seg_kv_slots, *prefill.rerotate[0]], page_size),
            pages_of([prefill.slots, *prefill.rerotate[1]], page_size),
        )
    d = (empty, empty)
    if decode is not None:
        d = (pages_of(decode.table_writes[2], page_size), pages_of([decode.slots], page_size))
    return p, d
