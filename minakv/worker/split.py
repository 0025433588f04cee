"""One step's `ForwardBatch` cut into the prefill worker's part and the decode worker's part.

The scheduler builds one batch per step, decode queries first, then prefill segments (minakv/worker/batch.py).
With separate workers (docs/workers.md) the decode queries, the key-table writes and their sample rows go to
the decode worker; the segments, the re-rotation copies and their sample rows to the prefill worker:

    batch      [d0 d1 d2 | s0 s0 s0 s1 s1]      decode tokens, then two segments
    samples    [d0 d1 d2 | s0-last s1-last]     sample rows follow the same order (decodes first)
    decode     [d0 d1 d2]                       samples 0..2, table writes
    prefill    [s0 s0 s0 s1 s1]                 samples 3..4 as 0..1, copies, segment keys

So the step's tokens are the decode part's followed by the prefill part's, in the batch's sample-row order.
With pools of workers, each part is cut further (`take_decodes`, `take_prefill`: the decode queries of some
rows, the segment pieces and copies of some groups, each with its sample rows); placement.py chooses the
cut. Inputs that reference the previous step's samples (`-(j + 1)`) are renumbered by the parent against
what each worker will see (minakv/worker/disagg.py).
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


def prefill_pages(part: ForwardBatch, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(the pages a prefill part reads, the pages it writes): it reads its segments' keys and its copies'
    sources, and writes its tokens' slots and its copies' destinations."""
    return (
        pages_of([*part.seg_kv_slots, *part.rerotate[0]], page_size),
        pages_of([part.slots, *part.rerotate[1]], page_size),
    )


def decode_pages(part: ForwardBatch, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(the pages a decode part reads, the pages it writes): it reads the keys written into its key table (a
    whole row when a request starts decoding, then one key a step) and writes its tokens' slots. Keys already
    in a table row are not read again here: a decoding request's pages never change elsewhere
    (docs/workers.md)."""
    reads = [*part.table_writes[2], *part.decode_key_writes()[2]]  # (a query's own key is read too)
    return pages_of(reads, page_size), pages_of([part.slots], page_size)


# ----- cutting a part further, for pools of workers (minakv/worker/placement.py chooses the cut) -----
def take_decodes(part: ForwardBatch, tokens: list[int]) -> tuple[ForwardBatch, list[int]]:
    """The decode queries `tokens` (indices into the decode part, in order) with their rows' table writes and
    their sample rows -> (the smaller part, the indices of its samples among the part's samples)."""
    rows = {part.decode_rows[i] for i in tokens}
    keep = [j for j, chunk in enumerate(part.table_writes[0]) if len(chunk) and int(chunk[0]) in rows]
    sub = ForwardBatch(
        input_ids=[part.input_ids[i] for i in tokens],
        positions=[part.positions[i] for i in tokens],
        slots=[part.slots[i] for i in tokens],
        num_decode=len(tokens),
        decode_rows=[part.decode_rows[i] for i in tokens],
        decode_lens=[part.decode_lens[i] for i in tokens],
        table_writes=tuple([column[j] for j in keep] for column in part.table_writes),
    )
    return sub, _take_samples(sub, part, {old: new for new, old in enumerate(tokens)})


def take_prefill(part: ForwardBatch, pieces: list[int], copies: list[int]) -> tuple[ForwardBatch, list[int]]:
    """The segment pieces `pieces` and the re-rotation chunks `copies` of a prefill part (in order), with the
    sample rows of their tokens -> (the smaller part, the indices of its samples among the part's samples)."""
    q = part.seg_q_indptr
    tokens = [t for p in pieces for t in range(q[p], q[p + 1])]
    sub = ForwardBatch(
        input_ids=[part.input_ids[t] for t in tokens],
        positions=[part.positions[t] for t in tokens],
        slots=[part.slots[t] for t in tokens],
        seg_q_indptr=np.cumsum([0] + [q[p + 1] - q[p] for p in pieces]).tolist(),
        seg_kv_indptr=np.cumsum([0] + [len(part.seg_kv_slots[p]) for p in pieces]).tolist(),
        seg_kv_slots=[part.seg_kv_slots[p] for p in pieces],
        seg_kv_pos=[part.seg_kv_pos[p] for p in pieces],
        rerotate=tuple([column[c] for c in copies] for column in part.rerotate),
    )
    return sub, _take_samples(sub, part, {old: new for new, old in enumerate(tokens)})


def _take_samples(sub: ForwardBatch, part: ForwardBatch, new_row: dict[int, int]) -> list[int]:
    """Give `sub` the sample rows of `part` whose token it kept (renumbered by `new_row`), with their
    parameters, penalty-table resets and grammar masks; returns their indices among `part`'s samples."""
    keep = [j for j, row in enumerate(part.sample_rows) if row in new_row]
    sub.sample_rows = [new_row[part.sample_rows[j]] for j in keep]
    sub.sample_params = [part.sample_params[j] for j in keep]
    sub.sample_seeds = [part.sample_seeds[j] for j in keep]
    sub.sample_counters = [part.sample_counters[j] for j in keep]
    sub.sample_penalty_rows = [part.sample_penalty_rows[j] for j in keep]
    penalised = set(sub.sample_penalty_rows) - {-1}  # (a reset always comes with its row's sample)
    sub.penalty_resets = [x for x in part.penalty_resets if x[0] in penalised]
    index = {j: i for i, j in enumerate(keep)}
    masks = [(index[s], m) for m, s in enumerate(part.mask_rows) if s in index]
    sub.mask_rows = [i for i, _ in masks]
    sub.token_mask = part.token_mask[[m for _, m in masks]] if masks else None
    return keep
