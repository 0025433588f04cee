"""FP8 linear layers (W8A16): y = x @ W^T + b with W resident as FP8 e4m3 plus 128x128 block scales and
dequantized in registers (minakv/ops/fp8_tile.py has the layout and the scaled dot).

Why: MiniMax-M2's attention projections are 18.9 MB (q, o) and 3.1 MB (k, v) per layer in FP8, twice that in
bf16, and at decode the product is bound by those bytes.

One kernel, a grid of (row blocks, column blocks, K splits):

       x [T, K] (bf16)           W [N, K] (fp8) + scales       program (m, n, s): rows m.. of x, output
      +-----------+            +-----------+-----------+       columns n.. of W, the inputs of split s,
    m |###########|          n |  split 0  |  split 1  |       in BLOCK_K steps:
      +-----------+            +-----------+-----------+         acc += (x @ Wq^T) * s[n // 128, k // 128]

    split_k == 1   + bias, cast to x's dtype, store y
    split_k  > 1   store fp32 partials [S, T, N]; a second kernel sums them in split order (+ bias, cast):
                   deterministic, no atomics

- Decode (T up to 64): one block of 16..64 rows, 64 output columns a program. The weight is the cost, and
  N / 64 programs alone cannot keep the memory system busy (k_proj: 16 programs for 132 SMs), so K is split
  until there are about two programs per SM, each split at least 4 scale blocks (512 inputs) long.
- Prefill (T larger): 64- or 128-row tiles of 128 columns, a split only while the tiles are too few and the
  partials stay small next to the weight.

Up to GEMV_MAX_ROWS rows `linear_fp8` takes fp8_gemv.py's GEMV instead (CUDA cores, more bytes in flight).
`linear_fp8` picks the kernel for CUDA tensors and `linear_fp8_ref` (dequantize, then F.linear) otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from minakv.ops.fp8_gemv import linear_fp8_gemv
from minakv.ops.fp8_tile import BLOCK, check_fp8_weight, f32_dot, fp8_rows, scaled_dot
from minakv.ops.quant import dequantize_fp8_block
from minakv.ops.triton_util import check, num_sms, use_triton

DECODE_MAX_ROWS = 64  # up to this many rows: decode tiles (one row block, K split to fill the GPU)
GEMV_MAX_ROWS = 1  # up to this many: a GEMV per row on the CUDA cores (fp8_gemv.py). It reads the weight once
# per row: on the H200 at 4 rows q_proj took 0.043 ms against ~0.019 for the tensor cores (RESULTS.md)


def linear_fp8(
    x: torch.Tensor,  # [..., in] bf16 / fp16 / fp32
    weight: torch.Tensor,  # float8_e4m3fn [out, in]
    scale_inv: torch.Tensor,  # f32 [ceil(out/128), ceil(in/128)]
    bias: torch.Tensor | None = None,  # [out]
) -> torch.Tensor:
    """x @ W^T (+ bias) -> [..., out] in x's dtype: the Triton kernel for CUDA tensors, else the reference."""
    if use_triton(x):
        if x.numel() <= GEMV_MAX_ROWS * x.shape[-1]:
            return linear_fp8_gemv(x, weight, scale_inv, bias)
        return linear_fp8_triton(x, weight, scale_inv, bias)
    return linear_fp8_ref(x, weight, scale_inv, bias)


def linear_fp8_ref(x, weight, scale_inv, bias=None) -> torch.Tensor:
    """The torch path (CPU forward): dequantize the whole weight to x's dtype, then F.linear."""
    check_fp8_weight(weight, scale_inv)
    return F.linear(x, dequantize_fp8_block(weight, scale_inv, BLOCK, x.dtype), bias)


def plan(rows: int, out: int, inp: int, sms: int) -> dict[str, int]:
    """Tile sizes, warps, stages and K split for a [rows, inp] x [inp, out] product (module docstring)."""
    if rows <= DECODE_MAX_ROWS:
        cfg = {"block_m": max(16, triton.next_power_of_2(rows)), "block_n": 64, "block_k": 128}
        cfg |= {"num_warps": 4, "num_stages": 4}
    else:
        cfg = {"block_m": 64 if rows <= 512 else 128, "block_n": 128, "block_k": 64}
        cfg |= {"num_warps": 8, "num_stages": 3}
    tiles = triton.cdiv(rows, cfg["block_m"]) * triton.cdiv(out, cfg["block_n"])
    k_blocks = triton.cdiv(inp, BLOCK)
    # two programs per SM, splits of >= 4 scale blocks, partials (written and read in fp32) under half the weight
    cfg["split_k"] = max(1, min(triton.cdiv(2 * sms, tiles), k_blocks // 4, inp // (8 * rows)))
    return cfg


def linear_fp8_triton(x, weight, scale_inv, bias=None, *, block_m: int | None = None,
                      block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
                      num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:  # fmt: skip
    """The kernel. Knobs left None come from `plan`; they are for benchmarks and tests (block_k divides 128;
    split_k is rounded to whole scale blocks per split)."""
    check_fp8_weight(weight, scale_inv)
    out_features, in_features = weight.shape
    check(x.shape[-1] == in_features, f"x is {tuple(x.shape)}, expected [..., {in_features}]")
    if bias is not None:
        check(bias.shape == (out_features,), f"bias is {tuple(bias.shape)}, expected ({out_features},)")
    lead = x.shape[:-1]
    x = x.reshape(-1, in_features)
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.shape[0]
    cfg = plan(rows, out_features, in_features, num_sms(x.device))
    given = {"block_m": block_m, "block_n": block_n, "block_k": block_k, "split_k": split_k,
             "num_warps": num_warps, "num_stages": num_stages}  # fmt: skip
    cfg |= {key: value for key, value in given.items() if value is not None}
    # whole scale blocks per split, so no BLOCK_K step straddles two splits
    k_blocks = triton.cdiv(in_features, BLOCK)
    split_len = triton.cdiv(k_blocks, min(cfg["split_k"], k_blocks)) * BLOCK
    splits = triton.cdiv(in_features, split_len)
    scale_inv = scale_inv.contiguous()

    y = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(rows, cfg["block_m"]), triton.cdiv(out_features, cfg["block_n"]), splits)
    partial = splits > 1
    dest = torch.empty(splits, rows, out_features, dtype=torch.float32, device=x.device) if partial else y
    _linear_kernel[grid](
        x, weight, scale_inv, bias if bias is not None else scale_inv, dest,
        rows, out_features, in_features, split_len,
        x.stride(0), weight.stride(0), scale_inv.stride(0), dest.stride(-2),
        HAS_BIAS=bias is not None, PARTIAL=partial, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"], F32_DOT=f32_dot(x), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if partial:
        size = rows * out_features
        _sum_splits_kernel[(triton.cdiv(size, 1024),)](
            dest, bias if bias is not None else dest, y, size, out_features, splits,
            HAS_BIAS=bias is not None, BLOCK=1024,
        )  # fmt: skip
    return y.view(*lead, out_features)


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, SPLIT_LEN, stride_xm, stride_wn, stride_sn, stride_ym,
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_n, n_ok, w_rows, s_rows = fp8_rows(w_ptr, s_ptr, tl.program_id(1) * BLOCK_N, N, stride_wn, stride_sn,
                                            BLOCK_N)  # fmt: skip
    split = tl.program_id(2)
    k_start = tl.multiple_of(split * SPLIT_LEN, 128)  # known alignment: vector loads, not byte loads
    k_end = tl.minimum(k_start + SPLIT_LEN, K)
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        a = tl.load(x_rows + k0, mask=m_ok[:, None] & (k0 + offs_k < K)[None, :], other=0.0)
        acc = scaled_dot(a, w_rows, s_rows, n_ok, k0, K, acc, BLOCK_K, F32_DOT)
    mask = m_ok[:, None] & n_ok[None, :]
    if PARTIAL:  # fp32 partials [splits, M, N]; _sum_splits_kernel adds the bias
        y_tile = (
            y_ptr + split.to(tl.int64) * M * N + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        )
        tl.store(y_tile, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y_tile = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_tile, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits_kernel(p_ptr, b_ptr, y_ptr, MN, N, SPLITS, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """y = sum over the splits of the partials (in split order: deterministic) + bias, in y's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLITS):
        acc += tl.load(p_ptr + s * MN + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)
