"""The tensor-core GEMV of mxfp4_mma.py with its 8 MMA columns filled: up to 8 pairs of one expert at once.

The per-pair GEMV reads an expert once per pair that chose it, so it only pays while the pairs are no more
than the experts. Here the pairs are first grouped by expert on the device (moe_groups.group_by_expert,
tiles of 8 rows), and a program takes one tile (up to 8 pairs of one expert) and 16 weight rows: lane
(g, t) loads the inputs of the tile's pair g for its B fragment, so one read of the weights serves all 8
columns, and the C fragment's (row, column) sums go to their pairs:

    tiles   [e0: p1 p4] [e3: p0 p2 p5 p7 p8 p9 p10 p11] [e3: p12] ...   (<= 8 pairs of one expert each)
    program (tile, rows n..n+16)   4 warps x (load A once a group, 2 MMAs) -> C [16 rows, 8 pairs]
            lane (g, t) holds rows g, g + 8 x columns 2t, 2t + 1

An expert with 9-16 pairs takes two tiles and is read twice (the second time mostly from L2). Gate/up
writes h in pair order, down its k parts in fp32, as the per-pair kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minakv.ops.moe_groups import ACTIVATIONS, group_by_expert, k_parts, my_tile
from minakv.ops.mxfp4_mma import ROWS, WARPS, activate_store, expert_rows, mma_rows, pair_order, warp_sets

COLS = tl.constexpr(8)  # pairs a tile: the MMA's columns


@triton.jit
def _tile(order_ptr, counts_ptr, starts_ptr, tile_ends_ptr, num_experts, E_PAD: tl.constexpr):
    """This program's tile -> (expert (num_experts past the last tile), its pairs [COLS] (0 where absent),
    which are real, and for each thread the pair of its B column g = lane / 4)."""
    expert, _, _, pair, ok = my_tile(order_ptr, counts_ptr, starts_ptr, tile_ends_ptr, num_experts, COLS, E_PAD,
                                     COLS, COLS)  # fmt: skip
    g = (tl.arange(0, 32 * WARPS) % 32) // 4
    lane_pair = tl.sum(tl.where(g[:, None] == tl.arange(0, COLS)[None, :], pair[None, :], 0), 1)
    return expert, pair, ok, lane_pair


@triton.jit
def _column(pair, ok, col):
    """The pair of C column `col` (per lane, [32]) and whether it is real."""
    hit = col[:, None] == tl.arange(0, COLS)[None, :]
    return tl.sum(tl.where(hit, pair[None, :], 0), 1), tl.sum(tl.where(hit & ok[None, :], 1, 0), 1) > 0


@triton.jit
def _gate_up_grouped(
    x_ptr, wb_ptr, ws_ptr, b_ptr, order_ptr, counts_ptr, starts_ptr, tile_ends_ptr, h_ptr, num_experts,
    H, I, TOPK, limit, alpha, stride_x, stride_be, stride_bn, stride_se, stride_sn, stride_bias, stride_h,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, UNROLL: tl.constexpr, E_PAD: tl.constexpr,
):  # fmt: skip
    expert, pair, ok, lane_pair = _tile(order_ptr, counts_ptr, starts_ptr, tile_ends_ptr, num_experts, E_PAD)
    if expert >= num_experts:
        return
    row0, w_rows, s_rows = expert_rows(wb_ptr, ws_ptr, expert, I, stride_be, stride_bn, stride_se, stride_sn,
                                       GATE_UP=True)  # fmt: skip
    x_rows = x_ptr + (lane_pair // TOPK).to(tl.int64) * stride_x
    lane, s00, s01, s10, s11 = mma_rows(w_rows, s_rows, x_rows, stride_bn, stride_sn, 0, H // 32, I - row0,
                                         SETS=2, UNROLL=UNROLL)  # fmt: skip
    for k in tl.static_range(4):  # C fragment order: (g, 2t) (g, 2t+1) (g+8, 2t) (g+8, 2t+1)
        sums = s00 if k == 0 else (s01 if k == 1 else (s10 if k == 2 else s11))
        gate, up = warp_sets(sums)
        n = row0 + lane // 4 + 8 * (k // 2)
        col_pair, col_ok = _column(pair, ok, 2 * (lane % 4) + k % 2)
        h_row = h_ptr + col_pair.to(tl.int64) * stride_h
        activate_store(gate, up, n, col_ok & (n < I), b_ptr, expert, stride_bias, I, limit, alpha, h_row,
                       HAS_BIAS, ACT)  # fmt: skip


@triton.jit
def _down_grouped(
    h_ptr, wb_ptr, ws_ptr, b_ptr, order_ptr, counts_ptr, starts_ptr, tile_ends_ptr, weights_ptr, y_ptr,
    num_experts, I, H, stride_h, stride_be, stride_bn, stride_se, stride_sn, stride_bias, stride_y,
    HAS_BIAS: tl.constexpr, UNROLL: tl.constexpr, E_PAD: tl.constexpr,
):  # fmt: skip
    expert, pair, ok, lane_pair = _tile(order_ptr, counts_ptr, starts_ptr, tile_ends_ptr, num_experts, E_PAD)
    if expert >= num_experts:
        return
    e = expert.to(tl.int64)
    row0, w_rows, s_rows = expert_rows(wb_ptr, ws_ptr, expert, H, stride_be, stride_bn, stride_se, stride_sn,
                                       GATE_UP=False)  # fmt: skip
    x_rows = h_ptr + lane_pair.to(tl.int64) * stride_h
    lane, s00, s01, s10, s11 = mma_rows(w_rows, s_rows, x_rows, stride_bn, stride_sn, 0, I // 32, H - row0,
                                         SETS=1, UNROLL=UNROLL)  # fmt: skip
    for k in tl.static_range(4):
        sums = s00 if k == 0 else (s01 if k == 1 else (s10 if k == 2 else s11))
        out = tl.sum(sums, 0)
        n = row0 + lane // 4 + 8 * (k // 2)
        col_pair, col_ok = _column(pair, ok, 2 * (lane % 4) + k % 2)
        real = col_ok & (n < H)
        if HAS_BIAS:
            out += tl.load(b_ptr + e * stride_bias + n, mask=real, other=0.0).to(tl.float32)
        weight = tl.load(weights_ptr + col_pair, mask=real, other=0.0)
        tl.store(y_ptr + col_pair.to(tl.int64) * stride_y + n, out * weight, mask=real)


def moe_mxfp4_mma_grouped(x, w, topk_weights, topk_ids, gate_up_bias=None, down_bias=None, activation="silu",
                          limit=7.0, alpha=1.702, *, sum_k: bool = True, unroll: int = 4) -> torch.Tensor:  # fmt: skip
    """`moe_mxfp4_gemv`'s result (its first arguments), each expert read once per 8 of its pairs (CUDA only)."""
    num_tokens, k = topk_ids.shape
    num_pairs = num_tokens * k
    hidden = x.shape[1]
    gub, gus, db, ds = (w[key] for key in ("gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales"))
    num_experts, inter = gub.shape[0], gub.shape[1] // 2
    order, counts, starts, tile_ends, max_tiles = group_by_expert(topk_ids, num_experts, COLS.value)
    plan = (order, counts, starts, tile_ends)
    e_pad = triton.next_power_of_2(num_experts)
    dummy = counts
    x16 = pair_order(x)
    h = torch.empty(num_pairs, inter, dtype=torch.float16, device=x.device)
    _gate_up_grouped[(max_tiles, triton.cdiv(inter, ROWS))](
        x16, gub, gus, gate_up_bias if gate_up_bias is not None else dummy, *plan, h, num_experts, hidden, inter, k,
        float(limit), float(alpha), x16.stride(0), gub.stride(0), gub.stride(1), gus.stride(0), gus.stride(1),
        gate_up_bias.stride(0) if gate_up_bias is not None else 0, h.stride(0),
        HAS_BIAS=gate_up_bias is not None, ACT=ACTIVATIONS[activation], UNROLL=unroll, E_PAD=e_pad,
        num_warps=WARPS.value,
    )  # fmt: skip
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _down_grouped[(max_tiles, triton.cdiv(hidden, ROWS))](
        h, db, ds, down_bias if down_bias is not None else dummy, *plan, weights, y, num_experts, inter, hidden,
        h.stride(0),
        db.stride(0), db.stride(1), ds.stride(0), ds.stride(1), down_bias.stride(0) if down_bias is not None else 0,
        y.stride(0), HAS_BIAS=down_bias is not None, UNROLL=unroll, E_PAD=e_pad, num_warps=WARPS.value,
    )  # fmt: skip
    return k_parts(y, num_tokens, k, x.dtype, sum_k)
