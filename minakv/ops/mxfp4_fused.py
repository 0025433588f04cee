"""MXFP4 MoE for few pairs, the interpreter's path (and the GPU's where the tensor-core kernels do not fit):
the two kernels of fused_moe.py with a packed weight tile (minakv/ops/mxfp4_tile.py unpacks it). Each
program owns (expert, block of output columns), finds its expert's pairs by scanning the id list (no
sort), and reads its packed tile once:

      pairs  p0 p1 p2 p3 | p4 ...          kernel 1 (e, n..n+BN of I):  gate, up tiles of the same
      ids    3  0  7  1  | 3  ...             columns -> bias -> activation, in registers -> h[p, n:]
                                           kernel 2 (e, n..n+BN of H):  h @ down^T + bias, x weight(p)
                                              -> y[p, n:] in fp32;  out[t] = sum over t's k slots

`moe_mxfp4` (minakv/ops/mxfp4_moe.py) picks this path or another.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minakv.ops.fused_moe import _my_pairs, _pairs_of_rows
from minakv.ops.moe_groups import ACTIVATIONS, activate_tile, k_parts
from minakv.ops.mxfp4_gemv import finish_gate_up, k_per_split
from minakv.ops.mxfp4_layout import packed_rows
from minakv.ops.mxfp4_tile import (
    MODES,
    dot_dtypes,
    load_act,
    mxfp4_acc,
    packed_shapes,
    scaled_mode,
    split_col,
)
from minakv.ops.triton_util import check


def moe_mxfp4_fused(x, w, topk_weights, topk_ids, gate_up_bias=None, down_bias=None, activation="silu",
                    limit=7.0, alpha=1.702, *, sum_k: bool = True, block_m: int | None = None,
                    block_n: int | None = None, block_k: int = 128, num_warps: int = 4, num_stages: int = 3,
                    mode: str = "auto", slots: str = "auto", splits: int = 1) -> torch.Tensor:  # fmt: skip
    """The decode path: two kernels, each chosen expert's packed weights read once. The keyword-only knobs
    are for benchmarks and tests (block_k: a multiple of 32). mode: how a tile is consumed (mxfp4_tile.MODES),
    or "auto" (the default): "split" with 32 output columns per program while the pairs are fewer than the
    experts, else "scaled" (tl.dot_scaled; "split" for activations other than bf16) with 64. On the H200
    (RESULTS.md "MXFP4 MoE kernels", `cc65c7e` and this session's run) at one token split took 0.093 ms
    against 0.101 for scaled, at 8 tokens 0.365 against 0.343, at 64 tokens 0.681 against 0.490 (20b).
    slots: "experts", a program row per expert (most return at once when T*k << E); "pairs", a program row
    per pair, the first pair of each expert serving it (the others return): T*k rows instead of E; "auto"
    (the default), the fewer: on the H200 at one token 0.093 ms against 0.130 for 120b's 128 experts, 0.092
    against 0.105 for 20b's 32. splits: programs per output block along K (split-K: more programs, and
    more bytes in flight, when few pairs leave the GPU's SMs short of work; docs/kernels.md). Each writes
    fp32 partial sums: gate/up's are summed by mxfp4_gemv.finish_gate_up (bias, activation), down's are
    returned as extra parts (sum_k=False: [T, k * splits, H]) or summed here. On the H200 at one token split
    4 took "scaled" from 0.104 to 0.092 ms and did nothing for "split" (RESULTS.md "GEMVs for few pairs").
    The weights in tiles (mxfp4_layout.py)."""
    num_experts, hidden, inter = packed_shapes(x, w, topk_ids, activation)
    num_tokens, k = topk_ids.shape
    num_pairs = num_tokens * k
    check(
        (mode in MODES or mode == "auto") and slots in ("experts", "pairs", "auto") and splits >= 1,
        f"mode {mode!r}, slots {slots!r}, splits {splits!r}",
    )
    if mode == "auto":
        mode = "split" if num_pairs < num_experts else "scaled"
    mode = scaled_mode(mode, x)
    if block_n is None:
        block_n = 64 if mode == "scaled" else 32
    by_pair = slots == "pairs" or (slots == "auto" and num_pairs < num_experts)
    if block_m is None:  # twice the average rows per expert (most experts in one pass), >= a tensor-core tile
        block_m = triton.next_power_of_2(triton.cdiv(2 * num_pairs, num_experts))
        block_m = min(64, max(16, block_m)) if mode != "fma" else min(4, block_m)
    x = x.contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    pairs_pad = max(16, triton.next_power_of_2(num_pairs))
    bf16, f32_dot = dot_dtypes(x)
    dummy = ids  # any pointer, for absent biases
    gub, gus, db, ds = (w[key] for key in ("gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales"))
    meta = {
        "PAIRS_PAD": pairs_pad,
        "BY_PAIR": by_pair,
        "MODE": MODES[mode],
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "BF16": bf16,
        "F32_DOT": f32_dot,
        "SPLITS": splits,
        "num_warps": num_warps,
        "num_stages": num_stages,
    }
    rows = num_pairs if by_pair else num_experts

    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # split columns in modes 1-3
    # with split-K the kernel writes fp32 partials [splits, pairs, gate I | up I] instead of h
    partial = (
        torch.empty(splits, num_pairs, 2 * inter, dtype=torch.float32, device=x.device) if splits > 1 else h
    )
    _gate_up_kernel[(rows, triton.cdiv(inter, block_n), splits)](
        x, gub, gus, gate_up_bias if gate_up_bias is not None else dummy, ids, partial,
        num_pairs, hidden, inter, k, float(limit), float(alpha), k_per_split(hidden, block_k, splits),
        x.stride(0), gub.stride(0), gub.stride(1), gus.stride(0), gus.stride(1), gate_up_bias.stride(0) if gate_up_bias is not None else 0,
        partial.stride(-2), HAS_BIAS=gate_up_bias is not None, ACT=ACTIVATIONS[activation], **meta,
    )  # fmt: skip
    if splits > 1:
        finish_gate_up(partial, gate_up_bias, ids, h, activation, limit, alpha, int(MODES[mode] in (1, 2, 3)))
    # down: row pair * splits + s holds split s's part, so the parts of a token stay together
    y = torch.empty(num_pairs * splits, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _down_kernel[(rows, triton.cdiv(hidden, block_n), splits)](
        h, db, ds, down_bias if down_bias is not None else dummy, ids, weights, y,
        num_pairs, inter, hidden, k_per_split(inter, block_k, splits), h.stride(0), db.stride(0), db.stride(1),
        ds.stride(0), ds.stride(1), down_bias.stride(0) if down_bias is not None else 0, y.stride(0),
        HAS_BIAS=down_bias is not None, **meta,
    )  # fmt: skip
    return k_parts(y, num_tokens, k * splits, x.dtype, sum_k)


@triton.jit
def _my_expert(ids_ptr, num_pairs, BY_PAIR: tl.constexpr, PAIRS_PAD: tl.constexpr):
    """The expert this program row serves: its number, or with BY_PAIR the expert of pair program_id(0)
    when that pair is the expert's first (else -2, which no pair has: the program returns)."""
    if BY_PAIR:
        slot = tl.program_id(0)
        offs = tl.arange(0, PAIRS_PAD)
        expert = tl.load(ids_ptr + slot).to(tl.int32)
        ids = tl.load(ids_ptr + offs, mask=offs < slot, other=-1).to(tl.int32)
        return tl.where(tl.sum((ids == expert).to(tl.int32), 0) > 0, -2, expert)
    return tl.program_id(0)


@triton.jit
def _gate_up_kernel(
    x_ptr, wb_ptr, ws_ptr, b_ptr, ids_ptr, h_ptr,
    num_pairs, H, I, TOPK, limit, alpha, K_SPLIT,
    stride_x, stride_be, stride_bn, stride_se, stride_sn, stride_bias, stride_h,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, PAIRS_PAD: tl.constexpr, BY_PAIR: tl.constexpr,
    MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BF16: tl.constexpr, F32_DOT: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    expert = _my_expert(ids_ptr, num_pairs, BY_PAIR, PAIRS_PAD)
    mine, number, count = _my_pairs(ids_ptr, num_pairs, expert, PAIRS_PAD)
    if count == 0:
        return
    offs_n, n_ok, gate_b, gate_s = packed_rows(
        wb_ptr, ws_ptr, expert, tl.program_id(1) * BLOCK_N, I, stride_be, stride_bn, stride_se, stride_sn,
        BLOCK_N,
    )  # fmt: skip
    up_b, up_s = gate_b + I * stride_bn, gate_s + I * stride_sn  # up rows I + n: the same columns of h
    if HAS_BIAS:
        b_gate = tl.load(b_ptr + expert * stride_bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        b_up = tl.load(b_ptr + expert * stride_bias + I + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    h_cols = split_col(offs_n, I, MODE)  # the down kernel reads h's halves contiguously
    for m0 in range(0, count, BLOCK_M):
        m_ok = m0 + tl.arange(0, BLOCK_M) < count
        pair = _pairs_of_rows(mine, number, m0, BLOCK_M, PAIRS_PAD)
        x_rows = x_ptr + (pair // TOPK).to(tl.int64)[:, None] * stride_x
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_lo = tl.program_id(2) * K_SPLIT
        for k0 in range(k_lo, tl.minimum(k_lo + K_SPLIT, H), BLOCK_K):
            a0, a1 = load_act(x_rows, m_ok, k0, H, BLOCK_K, MODE, False)
            acc_gate = mxfp4_acc(a0, a1, gate_b, gate_s, n_ok, k0, H, acc_gate, BLOCK_K, BF16, F32_DOT, MODE)
            acc_up = mxfp4_acc(a0, a1, up_b, up_s, n_ok, k0, H, acc_up, BLOCK_K, BF16, F32_DOT, MODE)
        mask = m_ok[:, None] & n_ok[None, :]
        if SPLITS > 1:  # fp32 partials [split, pair, gate | up] (h_ptr): gate_up_finish does the rest
            rows = h_ptr + (tl.program_id(2) * num_pairs + pair).to(tl.int64)[:, None] * stride_h
            tl.store(rows + offs_n[None, :], acc_gate, mask=mask)
            tl.store(rows + I + offs_n[None, :], acc_up, mask=mask)
        else:
            if HAS_BIAS:
                acc_gate += b_gate[None, :]
                acc_up += b_up[None, :]
            act = activate_tile(acc_gate, acc_up, limit, alpha, ACT)
            h_rows = h_ptr + pair.to(tl.int64)[:, None] * stride_h + h_cols[None, :]
            tl.store(h_rows, act.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _down_kernel(
    h_ptr, wb_ptr, ws_ptr, b_ptr, ids_ptr, weights_ptr, y_ptr,
    num_pairs, I, H, K_SPLIT, stride_h, stride_be, stride_bn, stride_se, stride_sn, stride_bias, stride_y,
    HAS_BIAS: tl.constexpr, PAIRS_PAD: tl.constexpr, BY_PAIR: tl.constexpr, MODE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BF16: tl.constexpr,
    F32_DOT: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    expert = _my_expert(ids_ptr, num_pairs, BY_PAIR, PAIRS_PAD)
    mine, number, count = _my_pairs(ids_ptr, num_pairs, expert, PAIRS_PAD)
    if count == 0:
        return
    offs_n, n_ok, w_b, w_s = packed_rows(
        wb_ptr, ws_ptr, expert, tl.program_id(1) * BLOCK_N, H, stride_be, stride_bn, stride_se, stride_sn,
        BLOCK_N,
    )  # fmt: skip
    if HAS_BIAS:
        bias = tl.load(b_ptr + expert * stride_bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    for m0 in range(0, count, BLOCK_M):
        m_ok = m0 + tl.arange(0, BLOCK_M) < count
        pair = _pairs_of_rows(mine, number, m0, BLOCK_M, PAIRS_PAD)
        h_rows = h_ptr + pair.to(tl.int64)[:, None] * stride_h
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_lo = tl.program_id(2) * K_SPLIT
        for k0 in range(k_lo, tl.minimum(k_lo + K_SPLIT, I), BLOCK_K):
            a0, a1 = load_act(h_rows, m_ok, k0, I, BLOCK_K, MODE, True)
            acc = mxfp4_acc(a0, a1, w_b, w_s, n_ok, k0, I, acc, BLOCK_K, BF16, F32_DOT, MODE)
        if HAS_BIAS:  # once per pair, whatever the splits: by split 0
            acc += tl.where(tl.program_id(2) == 0, bias, 0.0)[None, :]
        acc *= tl.load(weights_ptr + pair, mask=m_ok, other=0.0)[:, None]
        y_row = pair.to(tl.int64) * SPLITS + tl.program_id(2)
        y_rows = y_ptr + y_row[:, None] * stride_y + offs_n[None, :]
        tl.store(y_rows, acc, mask=m_ok[:, None] & n_ok[None, :])
