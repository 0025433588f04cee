"""FP8 (W8A16) mixture-of-experts: the experts' weights stay FP8 e4m3 with 128x128 block scales and are
dequantized in registers inside the GEMMs (minakv/ops/fp8_tile.py has the layout and the scaled dot).

Why: decode is bound by the bytes of the chosen experts. A MiniMax-M2 expert (H 3072, I 1536) is 14.2 MB in
FP8 plus 3 KB of scales, against 28.3 MB in bf16; the 62 layers' experts are 225 GB in FP8 and would be 450
in bf16.

    w = {"gate_up": fp8 [E, 2I, H],  "gate_up_scale_inv": f32 [E, 2 * ceil(I/128), ceil(H/128)],
         "down":    fp8 [E, H, I],   "down_scale_inv":    f32 [E, ceil(H/128), ceil(I/128)]}

(gate rows then up rows, a scale grid for each half). `moe_fp8` computes the same function as `moe_loop`
(minakv/ops/moe.py) on `dequantize_experts` of the same weights, and picks one of four paths:

  CPU tensors           `moe_fp8_ref`: each chosen expert dequantized to x's dtype, one matmul per expert.
  <= 16 pairs           `moe_fp8_gemv` (minakv/ops/fp8_gemv.py): a GEMV per pair on the CUDA cores (and no
                        more pairs than experts).
  few pairs (decode)    `moe_fp8_fused`, below: the two kernels of fused_moe.py with an FP8 weight tile.
                        Each program owns (expert, block of output columns), finds its expert's pairs as
                        they do (scanning the id list up to 64 pairs, else from a counting sort run
                        first), and reads its FP8 tile and scales once:

      pairs  p0 p1 p2 p3 | p4 ...          kernel 1 (e, n..n+BN of I):  gate, up tiles of the same
      ids    3  0  7  1  | 3  ...             columns -> bias -> activation, in registers -> h[p, n:]
                                           kernel 2 (e, n..n+BN of H):  h @ down^T + bias, x weight(p)
                                              -> y[p, n:] in fp32;  out[t] = sum over t's k slots

  many pairs (prefill)  `moe_fp8_grouped` (minakv/ops/fp8_grouped.py): pairs sorted by expert on the device,
                        a grouped GEMM over tiles of BLOCK_M rows of one expert.

The kernel paths end with a plain sum over each token's k slots (no atomics: deterministic; at decode the
GEMV and the fused kernels may hand the k parts to the next add_rms_norm instead, `sum_k`) and neither
syncs with the host, so a decode step stays capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minakv.ops.fp8_gemv import moe_fp8_gemv
from minakv.ops.fp8_grouped import moe_fp8_grouped
from minakv.ops.fp8_tile import (
    BLOCK,
    expert_shapes,
    f32_dot,
    fp8_rows,
    scaled_dot,
)
from minakv.ops.fused_moe import SCAN_MAX_PAIRS, _expert_rows, _row_pairs, find_rows
from minakv.ops.moe_groups import ACTIVATIONS, activate_tile, k_parts
from minakv.ops.quant import dequantize_fp8_block
from minakv.ops.triton_util import use_triton

# the fused kernels up to this many (token, slot) pairs (their id scan grows with them); then the grouped GEMM
FUSED_MAX_PAIRS = 512
# the GEMV up to this many pairs (and no more than the experts: each is read once per pair). On the H200 at
# MiniMax-M2's shapes it took 0.077 ms at 8 pairs against 0.114 for the fused kernels, 0.260 against 0.216 at
# 32 (bench/RESULTS.md "FP8 weights")
GEMV_MAX_PAIRS = 16


def moe_fp8(
    x: torch.Tensor,  # [T, H] bf16 / fp16 / fp32
    w: dict[str, torch.Tensor],  # gate_up, gate_up_scale_inv, down, down_scale_inv (module docstring)
    topk_weights: torch.Tensor,  # [T, k] float32
    topk_ids: torch.Tensor,  # [T, k]
    gate_up_bias: torch.Tensor | None = None,  # [E, 2I], gate/up halves like the weight rows
    down_bias: torch.Tensor | None = None,  # [E, H]
    activation: str = "silu",
    limit: float = 7.0,
    alpha: float = 1.702,
    sum_k: bool = True,
) -> torch.Tensor:
    """Sum over each token's k experts of weight * expert(x) -> [T, H] in x's dtype, the experts in FP8.
    sum_k=False lets the decode kernels return their k parts [T, k, H] fp32 for the next add_rms_norm to
    sum (minakv/ops/norm.py): two launches a layer fewer; the other paths sum anyway (as `moe`)."""
    args = (x, w, topk_weights, topk_ids, gate_up_bias, down_bias, activation, limit, alpha)
    if not use_triton(x):
        return moe_fp8_ref(*args)
    if topk_ids.numel() <= min(GEMV_MAX_PAIRS, w["gate_up"].shape[0]):
        return moe_fp8_gemv(*args, sum_k=sum_k)
    if topk_ids.numel() <= FUSED_MAX_PAIRS:
        return moe_fp8_fused(*args, sum_k=sum_k)
    return moe_fp8_grouped(*args)


def moe_fp8_ref(x, w, topk_weights, topk_ids, gate_up_bias=None, down_bias=None, activation="silu",
                limit=7.0, alpha=1.702) -> torch.Tensor:  # fmt: skip
    """The torch path (CPU forward): `moe_loop`'s grouping, each chosen expert dequantized to x's dtype when
    its turn comes (so the whole layer never exists dequantized). Syncs with the host."""
    from minakv.ops.moe import activate  # here, not at the top: moe.py may dispatch to this module

    num_experts, _, inter = expert_shapes(x, w, topk_ids, activation)
    halves = w["gate_up_scale_inv"].shape[1] // 2
    num_tokens, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    tokens, weights = order // k, topk_weights.reshape(-1)[order].float()
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        idx, wt = tokens[start : start + count], weights[start : start + count]
        start += count
        gu, gus = w["gate_up"][e], w["gate_up_scale_inv"][e]
        gate = dequantize_fp8_block(gu[:inter], gus[:halves], BLOCK, x.dtype)
        up = dequantize_fp8_block(gu[inter:], gus[halves:], BLOCK, x.dtype)
        h = x.index_select(0, idx) @ torch.cat([gate, up]).T
        if gate_up_bias is not None:
            h = h + gate_up_bias[e]
        h = (
            activate(h, activation, limit, alpha)
            @ dequantize_fp8_block(w["down"][e], w["down_scale_inv"][e], BLOCK, x.dtype).T
        )
        if down_bias is not None:
            h = h + down_bias[e]
        out.index_add_(0, idx, h.float() * wt[:, None])
    return out.to(x.dtype)


def moe_fp8_fused(x, w, topk_weights, topk_ids, gate_up_bias=None, down_bias=None, activation="silu",
                  limit=7.0, alpha=1.702, *, sum_k: bool = True, sort: bool | None = None,
                  block_m: int | None = None, block_n: int = 32, block_k: int = 128, num_warps: int = 4,
                  num_stages: int = 4) -> torch.Tensor:  # fmt: skip
    """The decode path: two kernels, each chosen expert's FP8 weights read once (sum_k as in `moe_fp8`). The
    other keyword-only knobs are for benchmarks and tests (block_k divides 128; sort None: sort above
    fused_moe's SCAN_MAX_PAIRS)."""
    num_experts, hidden, inter = expert_shapes(x, w, topk_ids, activation)
    num_tokens, k = topk_ids.shape
    num_pairs = num_tokens * k
    if block_m is None:  # twice the average rows per expert (most experts in one pass), >= a tensor-core tile
        block_m = min(64, max(16, triton.next_power_of_2(triton.cdiv(2 * num_pairs, num_experts))))
    x = x.contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    gu, db = w["gate_up"], w["down"]
    gus, ds = w["gate_up_scale_inv"].contiguous(), w["down_scale_inv"].contiguous()
    dummy = ids  # any pointer, for absent biases
    sort = num_pairs > SCAN_MAX_PAIRS if sort is None else sort
    rows, pairs_pad = find_rows(ids, num_experts, sort)
    meta = {"SORTED": sort, "PAIRS_PAD": pairs_pad, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
            "F32_DOT": f32_dot(x), "num_warps": num_warps, "num_stages": num_stages}  # fmt: skip

    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_experts, triton.cdiv(inter, block_n))](
        x, gu, gus, gate_up_bias if gate_up_bias is not None else dummy, *rows, h,
        num_pairs, hidden, inter, gus.shape[1] // 2, k, float(limit), float(alpha),
        x.stride(0), gu.stride(0), gu.stride(1), gus.stride(0), gus.stride(1),
        gate_up_bias.stride(0) if gate_up_bias is not None else 0, h.stride(0),
        HAS_BIAS=gate_up_bias is not None, ACT=ACTIVATIONS[activation], **meta,
    )  # fmt: skip
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _down_kernel[(num_experts, triton.cdiv(hidden, block_n))](
        h, db, ds, down_bias if down_bias is not None else dummy, *rows, weights, y,
        num_pairs, inter, hidden, h.stride(0), db.stride(0), db.stride(1), ds.stride(0), ds.stride(1),
        down_bias.stride(0) if down_bias is not None else 0, y.stride(0),
        HAS_BIAS=down_bias is not None, **meta,
    )  # fmt: skip
    return k_parts(y, num_tokens, k, x.dtype, sum_k)


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, ids_ptr, order_ptr, counts_ptr, starts_ptr, h_ptr,
    num_pairs, H, I, UP_SCALE_ROW, TOPK, limit, alpha,
    stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_bias, stride_h,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, SORTED: tl.constexpr, PAIRS_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    expert = tl.program_id(0)
    mine, number, count, start = _expert_rows(ids_ptr, counts_ptr, starts_ptr, num_pairs, expert, SORTED,
                                              PAIRS_PAD)  # fmt: skip
    if count == 0:
        return
    e = expert.to(tl.int64)
    w_e, s_e = w_ptr + e * stride_we, s_ptr + e * stride_se
    offs_n, n_ok, gate_w, gate_s = fp8_rows(w_e, s_e, tl.program_id(1) * BLOCK_N, I, stride_wn, stride_sn,
                                            BLOCK_N)  # fmt: skip
    # up rows I + n: the same columns of h as gate rows n, scales from the up half's grid
    up_w, up_s = gate_w + I * stride_wn, gate_s + UP_SCALE_ROW * stride_sn
    if HAS_BIAS:
        b_gate = tl.load(b_ptr + expert * stride_bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        b_up = tl.load(b_ptr + expert * stride_bias + I + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for m0 in range(0, count, BLOCK_M):
        pair, m_ok = _row_pairs(order_ptr, mine, number, count, start, m0, SORTED, BLOCK_M, PAIRS_PAD)
        x_rows = x_ptr + (pair // TOPK).to(tl.int64)[:, None] * stride_x + offs_k[None, :]
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            a = tl.load(x_rows + k0, mask=m_ok[:, None] & (k0 + offs_k < H)[None, :], other=0.0)
            acc_gate = scaled_dot(a, gate_w, gate_s, n_ok, k0, H, acc_gate, BLOCK_K, F32_DOT)
            acc_up = scaled_dot(a, up_w, up_s, n_ok, k0, H, acc_up, BLOCK_K, F32_DOT)
        if HAS_BIAS:
            acc_gate += b_gate[None, :]
            acc_up += b_up[None, :]
        act = activate_tile(acc_gate, acc_up, limit, alpha, ACT)
        h_rows = h_ptr + pair.to(tl.int64)[:, None] * stride_h + offs_n[None, :]
        tl.store(h_rows, act.to(h_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, s_ptr, b_ptr, ids_ptr, order_ptr, counts_ptr, starts_ptr, weights_ptr, y_ptr,
    num_pairs, I, H, stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_bias, stride_y,
    HAS_BIAS: tl.constexpr, SORTED: tl.constexpr, PAIRS_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    expert = tl.program_id(0)
    mine, number, count, start = _expert_rows(ids_ptr, counts_ptr, starts_ptr, num_pairs, expert, SORTED,
                                              PAIRS_PAD)  # fmt: skip
    if count == 0:
        return
    e = expert.to(tl.int64)
    offs_n, n_ok, w_rows, s_rows = fp8_rows(w_ptr + e * stride_we, s_ptr + e * stride_se,
                                            tl.program_id(1) * BLOCK_N, H, stride_wn, stride_sn, BLOCK_N)  # fmt: skip
    if HAS_BIAS:
        bias = tl.load(b_ptr + expert * stride_bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for m0 in range(0, count, BLOCK_M):
        pair, m_ok = _row_pairs(order_ptr, mine, number, count, start, m0, SORTED, BLOCK_M, PAIRS_PAD)
        h_rows = h_ptr + pair.to(tl.int64)[:, None] * stride_h + offs_k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            a = tl.load(h_rows + k0, mask=m_ok[:, None] & (k0 + offs_k < I)[None, :], other=0.0)
            acc = scaled_dot(a, w_rows, s_rows, n_ok, k0, I, acc, BLOCK_K, F32_DOT)
        if HAS_BIAS:
            acc += bias[None, :]
        acc *= tl.load(weights_ptr + pair, mask=m_ok, other=0.0)[:, None]
        y_rows = y_ptr + pair.to(tl.int64)[:, None] * stride_y + offs_n[None, :]
        tl.store(y_rows, acc, mask=m_ok[:, None] & n_ok[None, :])
