"""MXFP4 MoE for one token's pairs on the tensor cores, one warp per 16 weight rows, in inline PTX.

The CUDA-core GEMV (mxfp4_gemv.py) spends ~6 instructions per weight (decode, widen to fp32, one FMA each
weight), about as long as its reads take, so the two add up instead of overlapping (bench/RESULTS.md,
"GEMVs for few pairs"). Here a warp hands 16 rows x 32 inputs (one MXFP4 group) to two `mma.sync` m16n8k16
(fp16 operands, fp32 accumulation), whose 8 columns carry the pair's input in column 0 (the others'
results are not used). A program's 4 warps take 16 rows: for down, a quarter of the groups each; for
gate/up, warps 0-1 the gate rows and 2-3 the up rows, half of the groups each (so both are in flight):

    lane (g = lane / 4, t = lane % 4)  loads word t (8 codes) of the group in rows g and g + 8
    decode  word --shift, mask--> 4 E4M3 bytes x 2 --cvt.rn.f16x2.e4m3x2--> fp16 pairs of FP4 * 2^-6
            pairs (0, 2) (4, 6) | (1, 3) (5, 7): the A fragments of the two MMAs (inputs are summed, so
            any order of k does, if the activations' B fragments follow it)
    B       lane (g, t) loads word t's inputs of column g as fp16 in the same order (`pair_order`); here
            every column reads the pair's (mxfp4_mma_grouped.py gives each its own pairs)
    C       a group's fp32 sums of column 0 (lanes t = 0), times the rows' scales 2^(s - 127 + 6),
            added to the accumulators

About 2.5 instructions per weight in the loop's SASS against ~5-6, exact: FP4 * 2^-6 is an fp16, products
and sums are fp32. The activations go to fp16 (exact for |x| in [2^-14, 65504], saturated beyond; gate/up's
h is clamped by the activation, the hidden state is RMS-normed), permuted once per call for gate/up, and
written permuted by gate/up for down. A lane issues the loads of 4 groups (or 8: `unroll`) before it uses
any. `moe_mxfp4` takes this path on the GPU (mxfp4_moe.gemv_config); the interpreter has no inline
assembly and runs mxfp4_gemv.py's CUDA-core form.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minakv.ops.moe_groups import ACTIVATIONS, activate_tile, k_parts
from minakv.ops.mxfp4_mma_ptx import mma_rows_ptx
from minakv.ops.mxfp4_order import pair_order, pair_position
from minakv.ops.triton_util import pdl_options

WARPS = tl.constexpr(4)  # per program: they split the groups of the same 16 rows, then add their sums
ROWS = 16  # weight rows per program

MMA_ROWS_U4 = tl.constexpr(mma_rows_ptx(4))
MMA_ROWS_U8 = tl.constexpr(mma_rows_ptx(8))


@triton.jit
def mma_rows(w_rows, s_rows, x_rows, g_lo, g_hi, rows_left, SETS: tl.constexpr,
              UNROLL: tl.constexpr):  # fmt: skip
    """The work of MMA_ROWS_U4/U8 for this program's warps -> (lane [32], [WARPS, 32] partial sums of rows
    g and g + 8, `mxfp4_mma_ptx.mma_rows_ptx`). w_rows / s_rows / x_rows: [32 * WARPS] pointers, one per thread (the
    first weight row, its scales, the thread's column's inputs); the warps form SETS row sets (the warps of
    a set split its groups). One element per thread, so lane l of warp w is element 32 w + l."""
    zero = tl.arange(0, 32 * WARPS) * 0
    per_warp = tl.cdiv(g_hi - g_lo, WARPS // SETS)
    lane, s0, s1 = tl.inline_asm_elementwise(
        MMA_ROWS_U8 if UNROLL == 8 else MMA_ROWS_U4,
        "=r,=r,=r,l,l,l,r,r,r,r,r,r,r",
        [w_rows.to(tl.int64), s_rows.to(tl.int64), x_rows.to(tl.int64), (zero + 16).to(tl.int32),
         (zero + 1).to(tl.int32), (zero + g_hi).to(tl.int32), (zero + rows_left).to(tl.int32),
         (zero + per_warp).to(tl.int32), (zero + WARPS // SETS).to(tl.int32), (zero + g_lo).to(tl.int32)],
        dtype=(tl.int32, tl.float32, tl.float32), is_pure=True, pack=1,
    )  # fmt: skip
    lane = tl.max(tl.reshape(lane, (WARPS, 32)), 0)  # the same in every warp
    return lane, tl.reshape(s0, (WARPS, 32)), tl.reshape(s1, (WARPS, 32))


@triton.jit
def warp_sets(sums):
    """[WARPS, 32] partial sums of two row sets (warps 0, 1 and 2, 3) -> each set's sums [32]."""
    second = tl.arange(0, WARPS)[:, None] >= WARPS // 2
    return tl.sum(tl.where(second, 0.0, sums), 0), tl.sum(tl.where(second, sums, 0.0), 0)


@triton.jit
def _groups(num_groups, G_SPLIT):
    """This program's groups [lo, hi) of the input: split program_id(2) of G_SPLIT groups each."""
    lo = tl.program_id(2) * G_SPLIT
    return lo, tl.minimum(lo + G_SPLIT, num_groups)


@triton.jit
def expert_rows(wb_ptr, ws_ptr, expert, I, stride_be, stride_bn, stride_se, stride_sn, GATE_UP: tl.constexpr):
    """This program's 16 rows of the expert (program_id(1)) -> (first row, [32 * WARPS] pointers to each
    thread's first weight row and its scales): with GATE_UP, warps 0, 1 take the gate rows n and warps 2, 3
    the up rows I + n (both in flight at once)."""
    e = expert.to(tl.int64)
    row0 = tl.program_id(1) * 16
    w0 = wb_ptr + e * stride_be + row0 * stride_bn
    s0 = ws_ptr + e * stride_se + row0 * stride_sn
    if GATE_UP:
        up = tl.arange(0, 32 * WARPS) >= 16 * WARPS
        w_rows = tl.where(up, w0 + I * stride_bn, w0)
        s_rows = tl.where(up, s0 + I * stride_sn, s0)
    else:
        zero = tl.arange(0, 32 * WARPS).to(tl.int64) * 0
        w_rows, s_rows = w0 + zero, s0 + zero
    return row0, w_rows, s_rows


@triton.jit
def activate_store(gate, up, n, ok, b_ptr, expert, stride_bias, I, limit, alpha, h_row,
                   HAS_BIAS: tl.constexpr, ACT: tl.constexpr):  # fmt: skip
    """Gate/up's end for sums of rows n: bias, activation, h in pair order (down's B fragments read it)."""
    if HAS_BIAS:
        bias_row = b_ptr + expert.to(tl.int64) * stride_bias
        gate += tl.load(bias_row + n, mask=ok, other=0.0).to(tl.float32)
        up += tl.load(bias_row + I + n, mask=ok, other=0.0).to(tl.float32)
    act = activate_tile(gate, up, limit, alpha, ACT)
    tl.store(h_row + pair_position(n), act.to(tl.float16), mask=ok)


@triton.jit
def _gate_up_mma(
    x_ptr, wb_ptr, ws_ptr, b_ptr, ids_ptr, h_ptr, H, I, TOPK, limit, alpha, G_SPLIT,
    stride_x, stride_be, stride_bn, stride_se, stride_sn, stride_bias, stride_h,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, UNROLL: tl.constexpr, SPLITS: tl.constexpr,
    USE_GDC: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0)
    if USE_GDC:  # (triton_util.PDL) the ids and x are the kernels' before
        tl.extra.cuda.gdc_wait()
    expert = tl.load(ids_ptr + pair)
    row0, w_rows, s_rows = expert_rows(wb_ptr, ws_ptr, expert, I, stride_be, stride_bn, stride_se, stride_sn,
                                       GATE_UP=True)  # fmt: skip
    x_row = x_ptr + (pair // TOPK).to(tl.int64) * stride_x
    g_lo, g_hi = _groups(H // 32, G_SPLIT)
    zero = tl.arange(0, 32 * WARPS).to(tl.int64) * 0
    lane, sum_a, sum_b = mma_rows(w_rows, s_rows, x_row + zero, g_lo, g_hi, I - row0,
                                  SETS=2, UNROLL=UNROLL)  # fmt: skip
    if USE_GDC:  # the weights are read: the next kernel may start (it waits for this one to finish)
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.where(lane % 4 == 0, lane // 4, -1)  # column 0 (the pair) is held by the lanes of t = 0
    g_a, u_a = warp_sets(sum_a)
    g_b, u_b = warp_sets(sum_b)
    for half in tl.static_range(2):
        n = row0 + row + 8 * half
        ok = (row >= 0) & (n < I)
        gate = g_a if half == 0 else g_b
        up = u_a if half == 0 else u_b
        if SPLITS > 1:  # fp32 partials [split, pair, gate I | up I]: mxfp4_gemv.gate_up_finish does the rest
            part = h_ptr + (tl.program_id(2) * tl.num_programs(0) + pair).to(tl.int64) * stride_h
            tl.store(part + n, gate, mask=ok)
            tl.store(part + I + n, up, mask=ok)
        else:
            h_row = h_ptr + pair.to(tl.int64) * stride_h
            activate_store(gate, up, n, ok, b_ptr, expert, stride_bias, I, limit, alpha, h_row, HAS_BIAS, ACT)


@triton.jit
def _down_mma(
    h_ptr, wb_ptr, ws_ptr, b_ptr, ids_ptr, weights_ptr, y_ptr, I, H, G_SPLIT,
    stride_h, stride_be, stride_bn, stride_se, stride_sn, stride_bias, stride_y, HAS_BIAS: tl.constexpr,
    UNROLL: tl.constexpr, SPLITS: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0)
    if USE_GDC:  # (triton_util.PDL) h is the kernel before's
        tl.extra.cuda.gdc_wait()
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    row0, w_rows, s_rows = expert_rows(wb_ptr, ws_ptr, expert, H, stride_be, stride_bn, stride_se, stride_sn,
                                       GATE_UP=False)  # fmt: skip
    zero = tl.arange(0, 32 * WARPS).to(tl.int64) * 0
    h_row = h_ptr + pair.to(tl.int64) * stride_h
    g_lo, g_hi = _groups(I // 32, G_SPLIT)
    lane, sum_a, sum_b = mma_rows(w_rows, s_rows, h_row + zero, g_lo, g_hi, H - row0,
                                  SETS=1, UNROLL=UNROLL)  # fmt: skip
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.where(lane % 4 == 0, lane // 4, -1)
    y_a, y_b = tl.sum(sum_a, 0), tl.sum(sum_b, 0)
    weight = tl.load(weights_ptr + pair)
    # row pair * splits + s holds split s's part, so the parts of a token stay together
    y_row = y_ptr + (pair * SPLITS + tl.program_id(2)).to(tl.int64) * stride_y
    for half in tl.static_range(2):
        n = row0 + row + 8 * half
        ok = (row >= 0) & (n < H)
        out = y_a if half == 0 else y_b
        if HAS_BIAS:  # once per pair, whatever the splits: by split 0
            bias = tl.load(b_ptr + expert * stride_bias + n, mask=ok & (tl.program_id(2) == 0), other=0.0)
            out += bias.to(tl.float32)
        tl.store(y_row + n, out * weight, mask=ok)


def moe_mxfp4_mma(x, w, topk_weights, topk_ids, gate_up_bias=None, down_bias=None, activation="silu",
                  limit=7.0, alpha=1.702, *, sum_k: bool = True, unroll: int = 4,
                  splits: tuple[int, int] = (1, 1),
                  x16: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """`moe_mxfp4_gemv`'s result (its first arguments) from the tensor-core GEMV above (CUDA only).
    unroll: groups a step (4 or 8). splits: programs along the input for gate/up and for down (split-K:
    more, shorter chains of loads); gate/up's partials are summed by mxfp4_gemv.finish_gate_up, down's
    come back as extra parts (sum_k=False: [T, k * splits, H]) or are summed here. The weights in tiles
    (mxfp4_layout.py). x16: `pair_order(x)` if already made (the router's kernel writes it,
    routing.py)."""
    from minakv.ops.mxfp4_gemv import finish_gate_up  # here: mxfp4_gemv imports this module

    num_tokens, k = topk_ids.shape
    num_pairs = num_tokens * k
    hidden = x.shape[1]
    gub, gus, db, ds = (w[key] for key in ("gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales"))
    inter = gub.shape[1] // 2
    ids = topk_ids.reshape(-1).contiguous()
    dummy = ids
    x16 = pair_order(x) if x16 is None else x16
    gu_splits, d_splits = splits
    h = torch.empty(num_pairs, inter, dtype=torch.float16, device=x.device)
    partial = (
        torch.empty(gu_splits, num_pairs, 2 * inter, dtype=torch.float32, device=x.device)
        if gu_splits > 1
        else h
    )
    _gate_up_mma[(num_pairs, triton.cdiv(inter, ROWS), gu_splits)](
        x16, gub, gus, gate_up_bias if gate_up_bias is not None else dummy, ids, partial, hidden, inter, k,
        float(limit), float(alpha), triton.cdiv(hidden // 32, gu_splits), x16.stride(0), gub.stride(0),
        gub.stride(1), gus.stride(0), gus.stride(1), gate_up_bias.stride(0) if gate_up_bias is not None else 0,
        partial.stride(-2), HAS_BIAS=gate_up_bias is not None, ACT=ACTIVATIONS[activation],
        num_warps=WARPS.value, UNROLL=unroll, SPLITS=gu_splits, **pdl_options(),
    )  # fmt: skip
    if gu_splits > 1:
        finish_gate_up(partial, gate_up_bias, ids, h, activation, limit, alpha, cols=2)
    y = torch.empty(num_pairs * d_splits, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _down_mma[(num_pairs, triton.cdiv(hidden, ROWS), d_splits)](
        h, db, ds, down_bias if down_bias is not None else dummy, ids, weights, y, inter, hidden,
        triton.cdiv(inter // 32, d_splits), h.stride(0), db.stride(0), db.stride(1), ds.stride(0), ds.stride(1),
        down_bias.stride(0) if down_bias is not None else 0, y.stride(0), HAS_BIAS=down_bias is not None,
        num_warps=WARPS.value, UNROLL=unroll, SPLITS=d_splits, **pdl_options(),
    )  # fmt: skip
    return k_parts(y, num_tokens, k * d_splits, x.dtype, sum_k)
