"""Segment attention: the one prefill kernel for ordinary prefill, chunked prefill and restore.

A flat batch of query tokens is cut into segments. Segment g owns the queries
`q[seg_q_indptr[g]:seg_q_indptr[g+1]]`, whose own K/V were already stored at `q_slots`. Its queries see

  1. the context keys `kv_slots[seg_kv_indptr[g]:seg_kv_indptr[g+1]]` at positions `kv_pos[...]`
     (earlier chunks, or the keys active at a drop/reposition point during restore), and
  2. the segment's own causal prefix (query i sees own keys 0..i),

each subject to the position rule of docs/design.md 2.4: a key at position k is visible to a query at p iff
`0 <= p - k < window`. Sinks join the softmax denominator. Ordinary prefill is one segment per request
with an empty context; chunked prefill gives the earlier chunks as context.

The Triton kernel is flash attention over a gathered key list: `plan_segments` lays out each segment's
keys (context, then own tokens) as one list of slots and positions, once per forward for all layers.
One program per (query block, query head, segment) walks that list; blocks may straddle the
context/own boundary. In-order segments (as prefill and restore make them) take the elementwise mask
only on the diagonal and ragged blocks; with a window every block is masked and blocks wholly older than
the window are skipped. The torch reference ignores `max_seg_len` and `plan` (hints for the kernel).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from minakv.ops.attention import masked_attention, position_mask
from minakv.ops.triton_util import check, interpreting, use_triton

LOG2E = 1.4426950408889634


def segment_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [S, Hkv, D], one layer of the pool
    v_cache: torch.Tensor,  # [S, Hkv, D]
    q_pos: torch.Tensor,  # [T]
    q_slots: torch.Tensor,  # [T] where each query token's own K/V are stored
    seg_q_indptr: torch.Tensor,  # [G + 1]
    seg_kv_indptr: torch.Tensor,  # [G + 1]
    kv_slots: torch.Tensor,  # [N] context keys of all segments
    kv_pos: torch.Tensor,  # [N]
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]
    max_seg_len: int | None = None,  # host-side hint: longest segment (saves a device sync)
    plan: SegmentPlan | None = None,  # from plan_segments on the same metadata, shared by all layers
) -> torch.Tensor:
    """Attention output [T, Hq, D]: Triton on CUDA tensors, the torch reference otherwise."""
    fn = segment_attention_triton if use_triton(q) else segment_attention_ref
    args = (q_pos, q_slots, seg_q_indptr, seg_kv_indptr, kv_slots, kv_pos, scale, window, sinks, max_seg_len)
    return fn(q, k_cache, v_cache, *args, plan)


def segment_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_pos: torch.Tensor,
    q_slots: torch.Tensor,
    seg_q_indptr: torch.Tensor,
    seg_kv_indptr: torch.Tensor,
    kv_slots: torch.Tensor,
    kv_pos: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    max_seg_len: int | None = None,
    plan: SegmentPlan | None = None,
) -> torch.Tensor:
    """Torch reference: per segment, gather context + own keys and run the dense masked attention."""
    _check_inputs(q, k_cache, v_cache, q_pos, q_slots, seg_q_indptr, seg_kv_indptr, kv_slots, kv_pos, sinks)
    out = torch.zeros_like(q)
    q_bounds, kv_bounds = seg_q_indptr.tolist(), seg_kv_indptr.tolist()
    for g in range(len(q_bounds) - 1):
        qs, qe, ks, ke = q_bounds[g], q_bounds[g + 1], kv_bounds[g], kv_bounds[g + 1]
        if qs == qe:
            continue
        slots = torch.cat([kv_slots[ks:ke], q_slots[qs:qe]]).long()
        mask = position_mask(q_pos[qs:qe], torch.cat([kv_pos[ks:ke], q_pos[qs:qe]]), window)
        own = torch.ones(qe - qs, qe - qs, dtype=torch.bool, device=q.device).tril()
        mask[:, ke - ks :] &= own
        out[qs:qe] = masked_attention(q[qs:qe], k_cache[slots], v_cache[slots], mask, scale, sinks)
    return out


def segment_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_pos: torch.Tensor,
    q_slots: torch.Tensor,
    seg_q_indptr: torch.Tensor,
    seg_kv_indptr: torch.Tensor,
    kv_slots: torch.Tensor,
    kv_pos: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    max_seg_len: int | None = None,
    plan: SegmentPlan | None = None,
    *,
    block_m: int = 128,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
    maxnreg: int | None = 168,
) -> torch.Tensor:
    """The Triton kernel; the keyword-only knobs are for benchmarks and tests."""
    _check_inputs(q, k_cache, v_cache, q_pos, q_slots, seg_q_indptr, seg_kv_indptr, kv_slots, kv_pos, sinks)
    num_tokens, num_heads, head_dim = q.shape
    num_segments = seg_q_indptr.shape[0] - 1
    out = torch.empty_like(q)
    if num_tokens == 0 or num_segments == 0:
        return out.zero_()
    check(num_segments < 65536, f"at most 65535 segments per launch, got {num_segments}")
    if plan is None:
        plan = plan_segments(q_pos, q_slots, seg_q_indptr, seg_kv_indptr, kv_slots, kv_pos, max_seg_len)
    if plan.max_seg_len == 0:
        return out.zero_()
    grid = (num_heads, triton.cdiv(plan.max_seg_len, block_m), num_segments)
    _segment_kernel[grid](
        q, k_cache, v_cache, out, plan.q_pos, seg_q_indptr, seg_kv_indptr, plan.key_slots, plan.key_pos,
        plan.in_order, sinks if sinks is not None else plan.q_pos, scale * LOG2E,
        window if window is not None else 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        GROUP=num_heads // k_cache.shape[1], D=head_dim, D_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m, BLOCK_N=block_n, HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None,
        F32_DOT=q.dtype == torch.float32 or interpreting(), num_warps=num_warps, num_stages=num_stages,
        # A register cap of 168 fits three 4-warp programs per multiprocessor (H200 sweep: +13%).
        # (Not in the interpreter, which rejects it; tests/test_kernels_compile.py compiles with it on CPU.)
        **({"maxnreg": maxnreg} if maxnreg and not interpreting() else {}),
    )  # fmt: skip
    return out


class SegmentPlan(NamedTuple):
    """What the kernel needs besides q and the caches; the same for every layer of one forward."""

    key_slots: torch.Tensor  # int32 [N + T]: each segment's keys, context then own tokens
    key_pos: torch.Tensor  # int32 [N + T]
    in_order: torch.Tensor  # int32 [G]
    q_pos: torch.Tensor  # int32 [T]
    max_seg_len: int


def plan_segments(
    q_pos: torch.Tensor,
    q_slots: torch.Tensor,
    seg_q_indptr: torch.Tensor,
    seg_kv_indptr: torch.Tensor,
    kv_slots: torch.Tensor,
    kv_pos: torch.Tensor,
    max_seg_len: int | None = None,
) -> SegmentPlan:
    """Each segment's whole key list, context keys then own tokens, at offset seg_kv_indptr[g] +
    seg_q_indptr[g] of flat slot and position arrays (so the kernel reads one index per key); and per
    segment a flag, 1 if no context key comes after its first query and its own positions never
    decrease (prefill, chunked prefill, restore): then causality by index implies it by position, and
    without a window only the ragged and diagonal blocks need a mask. On the device; the only host
    sync is for max_seg_len when not given. Build it once per forward and pass it to every layer."""
    num_segments, device = seg_q_indptr.shape[0] - 1, q_pos.device
    num_ctx, num_q = kv_slots.shape[0], q_slots.shape[0]
    segs = torch.arange(num_segments, device=device)
    seg_of_q = torch.repeat_interleave(segs, seg_q_indptr.diff(), output_size=num_q)
    seg_of_kv = torch.repeat_interleave(segs, seg_kv_indptr.diff(), output_size=num_ctx)
    at_ctx = torch.arange(num_ctx, device=device) + seg_q_indptr[seg_of_kv]
    at_own = torch.arange(num_q, device=device) + seg_kv_indptr[seg_of_q + 1]
    # int32 indices and positions: int64 masks on [BLOCK_M, BLOCK_N] tiles would cost registers.
    key_slots = torch.empty(num_ctx + num_q, dtype=torch.int32, device=device)
    key_pos = torch.empty(num_ctx + num_q, dtype=torch.int32, device=device)
    key_slots[at_ctx], key_slots[at_own] = kv_slots.int(), q_slots.int()
    key_pos[at_ctx], key_pos[at_own] = kv_pos.int(), q_pos.int()

    first_q = torch.full((num_segments,), 2**62, device=device).scatter_reduce(
        0, seg_of_q, q_pos.long(), "amin"
    )
    last_kv = torch.full((num_segments,), -(2**62), device=device).scatter_reduce(
        0, seg_of_kv, kv_pos.long(), "amax"
    )
    backwards = ((q_pos[1:] < q_pos[:-1]) & (seg_of_q[1:] == seg_of_q[:-1])).int()
    steps_back = torch.zeros(num_segments, dtype=torch.int32, device=device).index_add(
        0, seg_of_q[1:], backwards
    )
    in_order = ((last_kv <= first_q) & (steps_back == 0)).to(torch.int32)
    if max_seg_len is None:
        max_seg_len = int(seg_q_indptr.diff().max().item()) if num_segments else 0
    return SegmentPlan(key_slots, key_pos, in_order, q_pos.int(), max_seg_len)


def _check_inputs(q, k_cache, v_cache, q_pos, q_slots, seg_q_indptr, seg_kv_indptr, kv_slots, kv_pos, sinks):
    check(q.dim() == 3, f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
    check(k_cache.dim() == 3 and k_cache.shape == v_cache.shape, "k_cache, v_cache must both be [S, Hkv, D]")
    check(k_cache.shape[2] == q.shape[2], f"head dim of q {q.shape[2]} != cache {k_cache.shape[2]}")
    check(q.shape[1] % k_cache.shape[1] == 0, f"{q.shape[1]} query heads not a multiple of KV heads")
    check(k_cache.stride(2) == 1 and q.stride(2) == 1, "q and caches need a contiguous head dim")
    check(q_pos.shape == (q.shape[0],) and q_slots.shape == (q.shape[0],), "q_pos and q_slots must be [T]")
    check(seg_q_indptr.dim() == 1 and seg_q_indptr.shape == seg_kv_indptr.shape, "indptrs must be [G + 1]")
    check(kv_slots.shape == kv_pos.shape and kv_slots.dim() == 1, "kv_slots and kv_pos must be [N] alike")
    check(sinks is None or sinks.shape == (q.shape[1],), "sinks must be [Hq]")
    check(k_cache.dtype == v_cache.dtype and k_cache.dtype in (q.dtype, torch.float8_e4m3fn),
          "k_cache and v_cache must share q's dtype, or be float8_e4m3fn")  # fmt: skip


@triton.jit
def _segment_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, q_pos_ptr, seg_q_ptr, seg_kv_ptr, key_slots_ptr, key_pos_ptr, in_order_ptr,
    sinks_ptr, scale_log2, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_ks, stride_kh, stride_vs, stride_vh,
    GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0)
    m_block = tl.num_programs(1) - 1 - tl.program_id(1)  # longest (causal) blocks first
    seg = tl.num_programs(2) - 1 - tl.program_id(2)  # later segments tend to have more context: first
    qs = tl.load(seg_q_ptr + seg)
    n_q = tl.load(seg_q_ptr + seg + 1) - qs
    if m_block * BLOCK_M >= n_q:
        return
    ks = tl.load(seg_kv_ptr + seg)
    n_ctx = tl.load(seg_kv_ptr + seg + 1) - ks
    in_order = tl.load(in_order_ptr + seg) != 0

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the segment
    row_ok = rows < n_q
    d = tl.arange(0, D_PAD)
    q_off = (qs + rows).to(tl.int64)
    q_mask = row_ok[:, None] & (d < D)[None, :]
    q = tl.load(q_ptr + q_off[:, None] * stride_qt + head * stride_qh + d[None, :], mask=q_mask, other=0.0)
    qp = tl.load(q_pos_ptr + qs + rows, mask=row_ok, other=0)
    qp_min = tl.min(tl.where(row_ok, qp, 2147483647), 0)

    # A finite floor instead of -inf for the running max: fully masked blocks then need no special case.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    # The key list: n_ctx context keys, then own token i at n_ctx + i (causal prefix). In an in-order
    # segment without a window, key blocks ending before this query block's first own token need no
    # mask: walk those first, then the rest (diagonal, ragged end) masked.
    keys = ks + qs  # offset of this segment's key list
    n_keys = n_ctx + tl.minimum(n_q, (m_block + 1) * BLOCK_M)
    unmasked_end = (tl.minimum(n_keys, n_ctx + m_block * BLOCK_M + 1) // BLOCK_N) * BLOCK_N
    if HAS_WINDOW:
        unmasked_end = 0
    unmasked_end = tl.where(in_order, unmasked_end, 0)
    acc, m_i, l_i = _attend_keys(
        acc, m_i, l_i, q, qp, qp_min, rows, keys, n_ctx, 0, unmasked_end, key_slots_ptr, key_pos_ptr,
        k_ptr, v_ptr, head // GROUP, stride_ks, stride_kh, stride_vs, stride_vh, scale_log2, window,
        D, D_PAD, BLOCK_N, False, HAS_WINDOW, F32_DOT,
    )  # fmt: skip
    acc, m_i, l_i = _attend_keys(
        acc, m_i, l_i, q, qp, qp_min, rows, keys, n_ctx, unmasked_end, n_keys, key_slots_ptr, key_pos_ptr,
        k_ptr, v_ptr, head // GROUP, stride_ks, stride_kh, stride_vs, stride_vh, scale_log2, window,
        D, D_PAD, BLOCK_N, True, HAS_WINDOW, F32_DOT,
    )  # fmt: skip

    if HAS_SINKS:  # one more logit in the denominator, with no value
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m_new = tl.maximum(m_i, sink)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.math.exp2(sink - m_new)
        acc = acc * alpha[:, None]
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # nothing visible and no sink: 0
    o_ptrs = out_ptr + q_off[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _attend_keys(
    acc, m_i, l_i, q, qp, qp_min, rows, keys, n_ctx, lo, hi, key_slots_ptr, key_pos_ptr, k_ptr, v_ptr,
    kv_head, stride_ks, stride_kh, stride_vs, stride_vh, scale_log2, window,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    HAS_WINDOW: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    """Online softmax over the key blocks [lo, hi) of a segment's key list. MASKED applies the ragged
    end, positions, index causality for own tokens and the window elementwise."""
    d = tl.arange(0, D_PAD)
    for j in range(lo, hi, BLOCK_N):
        cols = j + tl.arange(0, BLOCK_N)
        if MASKED:
            valid = cols < hi
            slot = tl.load(key_slots_ptr + keys + cols, mask=valid, other=0).to(tl.int64)
            kp = tl.load(key_pos_ptr + keys + cols, mask=valid, other=0)
            kv_mask = valid[:, None] & (d < D)[None, :]
        else:
            slot = tl.load(key_slots_ptr + keys + cols).to(tl.int64)
            kv_mask = (d < D)[None, :]
        run = True
        if HAS_WINDOW and MASKED:  # skip key blocks wholly older than the window for all queries here
            run = qp_min - tl.max(tl.where(valid, kp, -2147483647), 0) < window
        if run:
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
            if MASKED:
                own = cols - n_ctx  # own token index, negative for context keys
                visible = (kp[None, :] <= qp[:, None]) & (own[None, :] <= rows[:, None]) & valid[None, :]
                if HAS_WINDOW:
                    visible = visible & (kp[None, :] > qp[:, None] - window)
                s = tl.where(visible, s, float("-inf"))
            # Scores stay unscaled; the scale folds into one multiply-add inside exp2.
            m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
            p = tl.math.exp2(s * scale_log2 - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            if F32_DOT:
                acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(p.to(v.dtype), v, acc)
            m_i = m_new
    return acc, m_i, l_i


__all__ = [
    "SegmentPlan",
    "plan_segments",
    "segment_attention",
    "segment_attention_ref",
    "segment_attention_triton",
]
