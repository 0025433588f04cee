"""Decode attention: one new query per request over that request's active KV slots.

The keys of request b are `kv_slots[kv_indptr[b]:kv_indptr[b+1]]` (flat slot indices into one layer's
pool, so any page size works) with positions `kv_pos[...]`; with `kv_end` given, `kv_indptr` holds each
request's start instead, and its keys are `kv_slots[kv_indptr[b]:kv_end[b]]` (the engine's key table:
one fixed-width row per request); its query sits at `q_pos[b]` and reads a key
at position k iff `0 <= q_pos - k < window` (docs/design.md 2.4). Sinks join the softmax denominator.

The Triton path is flash-decoding: the keys of each request are cut into `num_splits` chunks, one
program per (request, KV head, chunk) computes an unnormalised partial softmax for all query heads of
that KV head at once (GQA packing: each K/V row is read once), and a second kernel merges the chunks
that hold keys and folds in the sinks. Decode is bound by the bytes of K and V read, so the splits exist
to put enough programs in flight to saturate memory bandwidth when the batch is small.

Chunks are cut one of two ways. Given the longest key list (`max_kv_len`, known on the host), every
request's chunks are the same size, enough for that list. Given `per_row_splits` instead, each program
cuts its own request's keys into that many equal chunks: nothing then depends on the key count, so one
captured CUDA graph serves a batch size at any history length (minakv/worker/graphs.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minakv.ops.attention import masked_attention, position_mask
from minakv.ops.triton_util import check, interpreting, num_sms, pdl_options, use_triton

LOG2E = 1.4426950408889634


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [S, Hkv, D], one layer of the pool
    v_cache: torch.Tensor,  # [S, Hkv, D]
    kv_indptr: torch.Tensor,  # [B + 1]
    kv_slots: torch.Tensor,  # [N]
    kv_pos: torch.Tensor,  # [N]
    q_pos: torch.Tensor,  # [B]
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]
    max_kv_len: int | None = None,  # host-side hint: longest key list (saves a device sync)
    kv_end: torch.Tensor | None = None,  # [B]: then kv_indptr is [B] starts
    ascending: bool = False,  # each request's keys sit at strictly increasing positions, none past q_pos
    per_row_splits: int | None = None,  # chunks of each request's own keys (then max_kv_len is not needed)
) -> torch.Tensor:
    """Attention output [B, Hq, D]: Triton on CUDA tensors, the torch reference otherwise."""
    args = (q, k_cache, v_cache, kv_indptr, kv_slots, kv_pos, q_pos, scale, window, sinks, max_kv_len, kv_end)
    if use_triton(q):
        return decode_attention_triton(*args, ascending=ascending, per_row_splits=per_row_splits)
    return decode_attention_ref(*args, ascending=ascending)


def default_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Chunks a request's keys are cut into: ~6 programs per multiprocessor (H200, batch 64 x 8k: 2 splits
    best, 1 split 40% slower, 16 splits 10% slower)."""
    return max(1, triton.cdiv(6 * num_sms(device), batch * num_kv_heads))


def _bounds(kv_indptr: torch.Tensor, kv_end: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-request (start, end) of the key range, from CSR offsets or explicit starts and ends."""
    return (kv_indptr[:-1], kv_indptr[1:]) if kv_end is None else (kv_indptr, kv_end)


def window_start(start: int, end: int, window: int | None, ascending: bool) -> int:
    """Where a request's visible keys can begin. With keys at strictly increasing (so distinct, integer)
    positions, none past the query's (the engine's rows: active keys in logical order, the query's own
    last), at most `window` of them lie in (q_pos - window, q_pos], and they are the last `window` keys.
    So a sliding-window layer reads at most the window, however long the history."""
    return max(start, end - window) if ascending and window is not None else start


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_slots: torch.Tensor,
    kv_pos: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    max_kv_len: int | None = None,
    kv_end: torch.Tensor | None = None,
    *,
    ascending: bool = False,
) -> torch.Tensor:
    """Torch reference: gather each request's keys and run the dense masked attention."""
    _check_inputs(q, k_cache, v_cache, kv_indptr, kv_slots, kv_pos, q_pos, sinks, kv_end)
    out = torch.empty_like(q)
    starts, ends = (t.tolist() for t in _bounds(kv_indptr, kv_end))
    for b in range(q.shape[0]):
        lo = window_start(starts[b], ends[b], window, ascending)
        slots = kv_slots[lo : ends[b]].long()
        mask = position_mask(q_pos[b : b + 1], kv_pos[lo : ends[b]].long(), window)
        out[b] = masked_attention(q[b : b + 1], k_cache[slots], v_cache[slots], mask, scale, sinks)[0]
    return out


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_slots: torch.Tensor,
    kv_pos: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    max_kv_len: int | None = None,
    kv_end: torch.Tensor | None = None,
    *,
    ascending: bool = False,
    per_row_splits: int | None = None,
    num_splits: int | None = None,
    block_n: int = 128,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """The split-K Triton kernel; the keyword-only knobs are for benchmarks and tests."""
    _check_inputs(q, k_cache, v_cache, kv_indptr, kv_slots, kv_pos, q_pos, sinks, kv_end)
    starts, ends = _bounds(kv_indptr, kv_end)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if batch == 0:
        return out
    if per_row_splits is not None:  # each program sizes its own chunk (keys_per_split 0, see the kernel)
        num_splits, keys_per_split = per_row_splits, 0
        if ascending and window is not None:  # a row reads at most `window` keys: chunks of 4+ blocks of them
            num_splits = max(1, min(num_splits, triton.cdiv(window, 4 * block_n)))
    else:
        if max_kv_len is None:
            max_kv_len = int((ends - starts).max().item())
        if ascending and window is not None:  # only the last `window` keys can be visible (window_start)
            max_kv_len = min(max_kv_len, window)
        if num_splits is None:  # never a chunk of fewer than 4 blocks of keys
            wanted = default_splits(batch, num_kv_heads, q.device)
            num_splits = max(1, min(wanted, triton.cdiv(max_kv_len, 4 * block_n)))
        keys_per_split = triton.cdiv(triton.cdiv(max(max_kv_len, 1), num_splits), block_n) * block_n

    part_acc = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(batch, num_heads, num_splits, 2, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(num_kv_heads, batch, num_splits)](
        q, k_cache, v_cache, starts, ends, kv_slots, kv_pos, q_pos, part_acc, part_ml,
        scale * LOG2E, window if window is not None else 0, keys_per_split,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        D=head_dim, D_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_N=block_n,
        HAS_WINDOW=window is not None, ASCENDING=ascending,
        F32_DOT=q.dtype == torch.float32 or interpreting(),
        num_warps=num_warps, num_stages=num_stages, **pdl_options(),
    )  # fmt: skip
    sinks_arg = sinks if sinks is not None else part_ml  # any pointer; unused without sinks
    _decode_merge_kernel[(batch, num_heads)](
        part_acc, part_ml, sinks_arg, out, starts, ends, window if window is not None else 0, keys_per_split,
        out.stride(0), out.stride(1), num_splits, D=head_dim, D_PAD=max(16, triton.next_power_of_2(head_dim)),
        SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)), BLOCK_N=block_n, HAS_WINDOW=window is not None,
        ASCENDING=ascending, HAS_SINKS=sinks is not None, num_warps=4, **pdl_options(),
    )  # fmt: skip
    return out


def _check_inputs(q, k_cache, v_cache, kv_indptr, kv_slots, kv_pos, q_pos, sinks, kv_end=None) -> None:
    check(q.dim() == 3, f"q must be [B, Hq, D], got shape {tuple(q.shape)}")
    check(k_cache.dim() == 3 and k_cache.shape == v_cache.shape, "k_cache, v_cache must both be [S, Hkv, D]")
    check(k_cache.shape[2] == q.shape[2], f"head dim of q {q.shape[2]} != cache {k_cache.shape[2]}")
    check(q.shape[1] % k_cache.shape[1] == 0, f"{q.shape[1]} query heads not a multiple of KV heads")
    check(k_cache.stride(2) == 1 and q.stride(2) == 1, "q and caches need a contiguous head dim")
    if kv_end is None:
        check(kv_indptr.shape == (q.shape[0] + 1,), f"kv_indptr must have B + 1 = {q.shape[0] + 1} entries")
    else:
        check(kv_indptr.shape == kv_end.shape == (q.shape[0],), "with kv_end, kv_indptr and kv_end are [B]")
    check(kv_slots.shape == kv_pos.shape and kv_slots.dim() == 1, "kv_slots and kv_pos must be [N] alike")
    check(q_pos.shape == (q.shape[0],), "q_pos must be [B]")
    check(sinks is None or sinks.shape == (q.shape[1],), "sinks must be [Hq]")
    check(k_cache.dtype == v_cache.dtype and k_cache.dtype in (q.dtype, torch.float8_e4m3fn),
          "k_cache and v_cache must share q's dtype, or be float8_e4m3fn")  # fmt: skip


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, start_ptr, end_ptr, slots_ptr, pos_ptr, q_pos_ptr, acc_ptr, ml_ptr,
    scale_log2, window, keys_per_split,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, ASCENDING: tl.constexpr, F32_DOT: tl.constexpr,
    USE_GDC: tl.constexpr,
):  # fmt: skip
    if USE_GDC:  # (triton_util.PDL) q and the pool are the kernels' before
        tl.extra.cuda.gdc_wait()
    # The split count is the grid's third size, not a compile-time constant: it changes with batch size
    # and key count, and a constant would compile a new kernel for each value in the middle of serving.
    kv_head = tl.program_id(0)  # fastest: the KV heads of one key row are read together
    b = tl.program_id(1)
    split = tl.program_id(2)
    NUM_SPLITS = tl.num_programs(2)
    start, end, chunk = _chunks(start_ptr, end_ptr, b, window, keys_per_split, NUM_SPLITS, BLOCK_N,
                                HAS_WINDOW, ASCENDING)  # fmt: skip
    lo = start + split * chunk
    hi = tl.minimum(end, lo + chunk)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    heads = kv_head * GROUP + g
    q_mask = (g < GROUP)[:, None] & (d < D)[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    qp = tl.load(q_pos_ptr + b)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for j in range(lo, hi, BLOCK_N):
        cols = j + tl.arange(0, BLOCK_N)
        valid = cols < hi
        slot = tl.load(slots_ptr + cols, mask=valid, other=0).to(tl.int64)
        kp = tl.load(pos_ptr + cols, mask=valid, other=0)
        kv_mask = valid[:, None] & (d < D)[None, :]
        # an fp8 cache is widened to q's dtype in registers (for bf16 caches this is a no-op)
        k = tl.load(
            k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0
        ).to(q.dtype)
        v = tl.load(
            v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0
        ).to(q.dtype)
        if F32_DOT:  # fp32 inputs: exact fp32 products, not tf32
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        diff = qp - kp
        visible = valid & (diff >= 0)
        if HAS_WINDOW:
            visible = visible & (diff < window)
        s = tl.where(visible[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet: avoid inf - inf
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if F32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if USE_GDC:  # the keys are read: the merge may start (it waits for this kernel to finish)
        tl.extra.cuda.gdc_launch_dependents()
    row = b * tl.num_programs(0) * GROUP + heads  # b * Hq + head
    # the merge reads only the chunks that hold keys, and the first (vectors: the interpreter rejects a
    # scalar in a mask)
    ok = (g < GROUP) & ((g * 0 + split == 0) | (g * 0 + lo < hi))
    tl.store(acc_ptr + (row[:, None] * NUM_SPLITS + split) * D + d[None, :], acc,
             mask=ok[:, None] & (d < D)[None, :])  # fmt: skip
    ml = ml_ptr + (row * NUM_SPLITS + split) * 2
    tl.store(ml, m_i, mask=ok)
    tl.store(ml + 1, l_i, mask=ok)


@triton.jit
def _chunks(start_ptr, end_ptr, b, window, keys_per_split, NUM_SPLITS, BLOCK_N: tl.constexpr,
            HAS_WINDOW: tl.constexpr, ASCENDING: tl.constexpr):  # fmt: skip
    """Request b's key range [start, end) and the keys of each of its chunks (whole blocks)."""
    start = tl.load(start_ptr + b)
    end = tl.load(end_ptr + b)
    if HAS_WINDOW and ASCENDING:  # the last `window` keys hold every visible one (window_start)
        start = tl.maximum(start, end - window)
    # keys_per_split 0: per-row splits, this request's own keys in NUM_SPLITS chunks of whole blocks
    own = tl.cdiv(tl.cdiv(end - start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    return start, end, tl.where(keys_per_split == 0, own, keys_per_split)


@triton.jit
def _decode_merge_kernel(
    acc_ptr, ml_ptr, sinks_ptr, out_ptr, start_ptr, end_ptr, window, keys_per_split, stride_ob, stride_oh,
    NUM_SPLITS, D: tl.constexpr, D_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, ASCENDING: tl.constexpr, HAS_SINKS: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    """One (request, head): the chunks' partial softmaxes that hold keys (a short history at batch 1 leaves
    most of ~100 chunks empty) merged, the sink folded in."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    if USE_GDC:  # (triton_util.PDL) the partials are the split kernel's
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    start, end, chunk = _chunks(start_ptr, end_ptr, b, window, keys_per_split, NUM_SPLITS, BLOCK_N,
                                HAS_WINDOW, ASCENDING)  # fmt: skip
    row = b * tl.num_programs(1) + h
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    sp_ok = sp < tl.maximum(tl.cdiv(end - start, tl.maximum(chunk, 1)), 1)  # (the split kernel's `used`)
    m = tl.load(ml_ptr + (row * NUM_SPLITS + sp) * 2, mask=sp_ok, other=float("-inf"))
    l = tl.load(ml_ptr + (row * NUM_SPLITS + sp) * 2 + 1, mask=sp_ok, other=0.0)
    acc = tl.load(
        acc_ptr + (row * NUM_SPLITS + sp[:, None]) * D + d[None, :],
        mask=sp_ok[:, None] & (d < D)[None, :],
        other=0.0,
    )
    m_all = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        m_all = tl.maximum(m_all, sink)
    m_use = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.math.exp2(m - m_use)
    denom = tl.sum(l * w, 0)
    if HAS_SINKS:
        denom += tl.math.exp2(sink - m_use)
    num = tl.sum(acc * w[:, None], 0)
    out = tl.where(denom > 0, num / tl.maximum(denom, 1e-30), 0.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


__all__ = ["decode_attention", "decode_attention_ref", "decode_attention_triton", "default_splits"]
