"""MXFP4 MoE for many tokens (prefill): a grouped GEMM over the (token, slot) pairs sorted by expert, the
packed weight tile dequantized in registers at every K step (minakv/ops/mxfp4_tile.py).

At prefill each expert gets hundreds of rows, so the GEMMs are worth tiling for M: a program takes BLOCK_M
rows of ONE expert. The grouping is built on the device, with no host sync:

    ids of the pairs (T*k)     3 0 3 1 0 3 ...
    sort (stable)       ->     order: pairs of expert 0 | expert 1 | expert 2 (none) | expert 3 ...
    counts [E]                 c0          c1            0                      c3
    starts [E]                 where each expert's rows begin in `order` (exclusive prefix sum)
    tile_ends [E]              prefix sum of ceil(c_e / BLOCK_M): expert e owns tiles tile_ends[e-1] ..

    grid: (upper bound of tiles) x (column blocks)    the bound ceil(P / BLOCK_M) + min(E, P) is known on
                                                      the host (each expert wastes at most one partial
                                                      tile); programs past the last real tile return.

A program finds its tile's expert by counting the tile_ends <= its tile (E is at most a few hundred), then:

  kernel 1 (tile, columns n.. of I): x rows of its pairs @ (gate | up)^T + bias -> activation -> h (sorted)
  kernel 2 (tile, columns n.. of H): h rows @ down^T + bias, times the routing weight -> y[pair] in fp32

and out[t] = the plain sum of y over t's k slots, as in the fused path. Programs are numbered tile-major
(a tile's column blocks run side by side), so a tile's activation rows are read from L2, and an expert's
consecutive tiles reuse its weights from L2 too.

At thousands of tokens each weight tile is dequantized once per BLOCK_M rows, many times per layer. The
default mode, "scaled", hands the packed tile to tl.dot_scaled, which upcasts it in the MMA operand's
layout (the cheapest dequantization Triton offers); mode "bf16" instead dequantizes all the experts once
(`dequantize_mxfp4_bf16`, a bandwidth-bound kernel) into a transient bf16 copy (4x the packed bytes: 1.6 GB
for a gpt-oss-20b layer) and runs the bf16 grouped GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minakv.ops.moe_groups import ACTIVATIONS, activate_tile, group_by_expert, my_tile
from minakv.ops.mxfp4_layout import packed_rows, untile_rows
from minakv.ops.mxfp4_tile import (
    MODES,
    dot_dtypes,
    e2m1_f16,
    load_act,
    mxfp4_acc,
    packed_shapes,
    scaled_mode,
    split_col,
)  # fmt: skip
from minakv.ops.triton_util import check


def moe_mxfp4_grouped(x, w, topk_weights, topk_ids, gate_up_bias=None, down_bias=None, activation="silu",
                      limit=7.0, alpha=1.702, *, block_m: int = 128, block_n: int | None = None,
                      block_k: int | None = None, num_warps: int = 8, num_stages: int = 3,
                      mode: str = "scaled") -> torch.Tensor:  # fmt: skip
    """The prefill path: tiles of block_m rows of one expert. The keyword-only knobs are for benchmarks and
    tests (block_k: a multiple of 32). mode: a tile mode of mxfp4_tile.MODES, or "bf16" (module docstring;
    the block knobs are then unused). "scaled" (tl.dot_scaled; "split" for activations other than bf16) is
    the default, with 128 x 128 x 128 blocks (64 x 64 for the other modes): on the H200 (bench/
    mxfp4_variants.py, RESULTS.md "MXFP4 MoE kernels") it beat "bf16" at 256 and 1,024 tokens (20b: 0.94 ms
    against 1.24, 1.37 against 1.70; 120b at 4,096: 4.85 against 6.40) and came close at 20b, 4,096 tokens
    (3.63 against 3.44). The weights in tiles (mxfp4_layout.py)."""
    num_experts, hidden, inter = packed_shapes(x, w, topk_ids, activation)
    check(mode in MODES or mode == "bf16", f"unknown mode {mode!r}")
    if mode == "bf16":
        from minakv.ops.moe import moe_grouped  # here: moe.py may dispatch to this module

        rows = untile_rows(
            w
        )  # dequantize reads rows: a transient copy of the packed bytes (1/4 of the bf16 one)
        gate_up = dequantize_mxfp4_bf16(rows["gate_up_blocks"], rows["gate_up_scales"], x.dtype)
        down = dequantize_mxfp4_bf16(rows["down_blocks"], rows["down_scales"], x.dtype)
        return moe_grouped(x, gate_up, down, topk_weights, topk_ids, gate_up_bias, down_bias, activation,
                           limit, alpha)  # fmt: skip
    mode = scaled_mode(mode, x)
    block_n = block_n or (128 if mode == "scaled" else 64)
    block_k = block_k or (128 if mode == "scaled" else 64)
    num_tokens, k = topk_ids.shape
    num_pairs = num_tokens * k
    order, counts, starts, tile_ends, max_tiles = group_by_expert(topk_ids, num_experts, block_m)
    x = x.contiguous()
    bf16, f32_dot = dot_dtypes(x)
    dummy = counts  # any pointer, for absent biases
    gub, gus, db, ds = (w[key] for key in ("gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales"))
    meta = {
        "E_PAD": triton.next_power_of_2(num_experts),
        "MODE": MODES[mode],
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "BF16": bf16,
        "F32_DOT": f32_dot,
        "num_warps": num_warps,
        "num_stages": num_stages,
    }
    plan = (order, counts, starts, tile_ends, num_experts)

    h = torch.empty(
        num_pairs, inter, dtype=x.dtype, device=x.device
    )  # sorted rows, split columns in modes 1-3
    _gate_up_kernel[(max_tiles * triton.cdiv(inter, block_n),)](
        x, gub, gus, gate_up_bias if gate_up_bias is not None else dummy, *plan, h,
        hidden, inter, k, float(limit), float(alpha),
        x.stride(0), gub.stride(0), gub.stride(1), gus.stride(0), gus.stride(1),
        gate_up_bias.stride(0) if gate_up_bias is not None else 0, h.stride(0),
        HAS_BIAS=gate_up_bias is not None, ACT=ACTIVATIONS[activation], **meta,
    )  # fmt: skip
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)  # rows in pair order
    weights = topk_weights.reshape(-1).float().contiguous()
    _down_kernel[(max_tiles * triton.cdiv(hidden, block_n),)](
        h, db, ds, down_bias if down_bias is not None else dummy, *plan, weights, y,
        inter, hidden, h.stride(0), db.stride(0), db.stride(1), ds.stride(0), ds.stride(1),
        down_bias.stride(0) if down_bias is not None else 0, y.stride(0),
        HAS_BIAS=down_bias is not None, **meta,
    )  # fmt: skip
    return y.view(num_tokens, k, hidden).sum(1).to(x.dtype)


@triton.jit
def _gate_up_kernel(
    x_ptr, wb_ptr, ws_ptr, b_ptr, order_ptr, counts_ptr, starts_ptr, tile_ends_ptr, num_experts, h_ptr,
    H, I, TOPK, limit, alpha,
    stride_x, stride_be, stride_bn, stride_se, stride_sn, stride_bias, stride_h,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, E_PAD: tl.constexpr, MODE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BF16: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    expert, n0, rows, pair, m_ok = my_tile(
        order_ptr, counts_ptr, starts_ptr, tile_ends_ptr, num_experts, I, E_PAD, BLOCK_M, BLOCK_N
    )
    if expert >= num_experts:
        return
    offs_n, n_ok, gate_b, gate_s = packed_rows(
        wb_ptr, ws_ptr, expert, n0, I, stride_be, stride_bn, stride_se, stride_sn, BLOCK_N
    )
    up_b, up_s = gate_b + I * stride_bn, gate_s + I * stride_sn  # up rows I + n: the same columns of h
    x_rows = x_ptr + (pair // TOPK).to(tl.int64)[:, None] * stride_x
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        a0, a1 = load_act(x_rows, m_ok, k0, H, BLOCK_K, MODE, False)
        acc_gate = mxfp4_acc(a0, a1, gate_b, gate_s, n_ok, k0, H, acc_gate, BLOCK_K, BF16, F32_DOT, MODE)
        acc_up = mxfp4_acc(a0, a1, up_b, up_s, n_ok, k0, H, acc_up, BLOCK_K, BF16, F32_DOT, MODE)
    if HAS_BIAS:
        acc_gate += tl.load(b_ptr + expert * stride_bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[
            None, :
        ]
        acc_up += tl.load(b_ptr + expert * stride_bias + I + offs_n, mask=n_ok, other=0.0).to(tl.float32)[
            None, :
        ]
    act = activate_tile(acc_gate, acc_up, limit, alpha, ACT)
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_h + split_col(offs_n, I, MODE)[None, :]
    tl.store(h_rows, act.to(h_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, wb_ptr, ws_ptr, b_ptr, order_ptr, counts_ptr, starts_ptr, tile_ends_ptr, num_experts,
    weights_ptr, y_ptr, I, H, stride_h, stride_be, stride_bn, stride_se, stride_sn, stride_bias, stride_y,
    HAS_BIAS: tl.constexpr, E_PAD: tl.constexpr, MODE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BF16: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    expert, n0, rows, pair, m_ok = my_tile(
        order_ptr, counts_ptr, starts_ptr, tile_ends_ptr, num_experts, H, E_PAD, BLOCK_M, BLOCK_N
    )
    if expert >= num_experts:
        return
    offs_n, n_ok, w_b, w_s = packed_rows(
        wb_ptr, ws_ptr, expert, n0, H, stride_be, stride_bn, stride_se, stride_sn, BLOCK_N
    )
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_h
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        a0, a1 = load_act(h_rows, m_ok, k0, I, BLOCK_K, MODE, True)
        acc = mxfp4_acc(a0, a1, w_b, w_s, n_ok, k0, I, acc, BLOCK_K, BF16, F32_DOT, MODE)
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * stride_bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    acc *= tl.load(weights_ptr + pair, mask=m_ok, other=0.0)[:, None]
    y_rows = y_ptr + pair.to(tl.int64)[:, None] * stride_y + offs_n[None, :]
    tl.store(y_rows, acc, mask=m_ok[:, None] & n_ok[None, :])


def dequantize_mxfp4_bf16(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks u8 [..., G, 16], scales u8 [..., G] -> W [..., G * 32] in dtype, on the device (equal to
    quant.dequantize_mxfp4: the select-free decode of mxfp4_tile, computed in fp32, then rounded to dtype)."""
    out = torch.empty(*blocks.shape[:-2], blocks.shape[-2] * 32, dtype=dtype, device=blocks.device)
    blocks, scales = blocks.contiguous(), scales.contiguous()
    BLOCK = 4096  # bytes per program
    _dequant_kernel[(triton.cdiv(blocks.numel(), BLOCK),)](blocks, scales, out, blocks.numel(), BLOCK=BLOCK)
    return out


@triton.jit
def _dequant_kernel(b_ptr, s_ptr, out_ptr, n_bytes, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_bytes
    packed = tl.load(b_ptr + offs, mask=ok, other=0)
    s = tl.load(s_ptr + offs // 16, mask=ok, other=0).to(tl.uint32) + 14  # the 2^14 of e2m1_f16 folded in
    scale = (s << 23).to(tl.float32, bitcast=True)
    lo = e2m1_f16(packed & 0xF).to(tl.float32) * scale
    hi = e2m1_f16(packed >> 4).to(tl.float32) * scale
    values = tl.reshape(tl.join(lo, hi), (2 * BLOCK,))  # byte j: elements 2j (low nibble), 2j + 1
    out_offs = tl.program_id(0).to(tl.int64) * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
    tl.store(out_ptr + out_offs, values.to(out_ptr.dtype.element_ty), mask=out_offs < 2 * n_bytes)
