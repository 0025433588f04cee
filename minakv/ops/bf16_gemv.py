"""bf16 linear for one row: y = x @ W^T (+ b) as a GEMV on the CUDA cores, for decode at batch 1.

At one token the attention projections are pure weight reads (gpt-oss: q/k/v 29.5 MB and o 23.6 MB a layer
in bf16), and cuBLAS read them at 44-67% of the copy bandwidth on the H200 (bench/RESULTS.md), with o_proj's
bias as a second kernel. This is the FP8 GEMV's shape (fp8_gemv.py) with bf16 weights: a program owns a
strip of BN output rows, each thread two 16-byte vectors (8 weights each) a step, one fp32 partial sum per
vector slot, the next step's weights and inputs loaded before this step's are used:

    W rows n..n+BN  | v0 v1 ... v(G-1) | vG ...       acc [BN, G] fp32, summed over G once at the end
    x row (bf16)    |  8  8  ...  8    |

and the bias added in the same kernel. Under programmatic dependent launch (triton_util.PDL) the first
weights are asked for before the wait on the kernel before: no kernel writes weights, and x is its output.

Strips of at most 4 rows (8 were the FP8 rule's pick for q/k/v): on an H100, one token on distinct weights
(bench/gemv_sweep.py, bench/RESULTS.md), q/k/v took 13.8 us against 15.7 at 8 rows and 14.8 in cuBLAS,
o_proj 12.1 against 15.2 in cuBLAS. `linear` sends one bf16 row on the GPU here and the rest to F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from minakv.ops.fp8_gemv import strip
from minakv.ops.triton_util import check, num_sms, pdl_options

WIDEST = 4  # rows per strip at most (see the module docstring)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, but one bf16 row on a CUDA device (decode at batch 1) through `linear_gemv`."""
    one_row = x.numel() == x.shape[-1]
    bf16 = x.dtype == weight.dtype == torch.bfloat16 and weight.stride(-1) == 1
    if one_row and x.is_cuda and bf16 and x.shape[-1] % 8 == 0:
        return linear_gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                block_n: int | None = None, groups: int | None = None, num_warps: int = 4) -> torch.Tensor:  # fmt: skip
    """x [..., in] @ W^T (+ bias) -> [..., out] in x's dtype, a program per (row of x, strip of W): meant for
    one row. block_n, groups (vectors of 8 inputs per row per step) and num_warps are for benchmarks."""
    out_features, in_features = weight.shape
    check(
        x.shape[-1] == in_features and in_features % 8 == 0, f"x is {tuple(x.shape)}, weight {weight.shape}"
    )
    check(weight.stride(-1) == 1, "the weight's rows must be contiguous")
    lead = x.shape[:-1]
    x = x.reshape(-1, in_features).contiguous()
    rows = x.shape[0]
    auto_n, auto_g = strip(rows, out_features, num_sms(x.device), WIDEST)
    block_n, groups = block_n or auto_n, groups or auto_g
    y = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    _linear_gemv_kernel[(rows, triton.cdiv(out_features, block_n))](
        x, weight, bias if bias is not None else weight, y, out_features, in_features, x.stride(0),
        weight.stride(0), y.stride(0), HAS_BIAS=bias is not None, BLOCK_N=block_n, GROUPS=groups,
        num_warps=num_warps, **pdl_options(),
    )  # fmt: skip
    return y.view(*lead, out_features)


@triton.jit
def _load(w_rows, n_ok, v0, K, GROUPS: tl.constexpr):
    """Vectors v0 .. v0 + G - 1 (inputs 8 v ..) of the rows -> [BN, G, 8]; 0 past K."""
    offs_v = v0 + tl.arange(0, GROUPS)
    ok = n_ok[:, None] & (offs_v < K // 8)[None, :]
    return tl.load(w_rows[:, :, None] + offs_v[None, :, None] * 8 + tl.arange(0, 8)[None, None, :],
                   mask=ok[:, :, None], other=0.0)  # fmt: skip


@triton.jit
def _load_x(x_row, v0, K, GROUPS: tl.constexpr):
    offs_v = v0 + tl.arange(0, GROUPS)
    return tl.load(x_row + offs_v[:, None] * 8 + tl.arange(0, 8)[None, :], mask=(offs_v < K // 8)[:, None],
                   other=0.0)  # fmt: skip


@triton.jit
def _linear_gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_x, stride_wn, stride_y,
                        HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
                        USE_GDC: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_row = x_ptr + row * stride_x
    w_next = _load(w_rows, n_ok, 0, K, GROUPS)  # (weights: before the wait, see the module docstring)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    x_next = _load_x(x_row, 0, K, GROUPS)
    acc = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    for v0 in range(0, K // 8, GROUPS):
        w, xs = w_next, x_next
        w_next = _load(w_rows, n_ok, v0 + GROUPS, K, GROUPS)
        x_next = _load_x(x_row, v0 + GROUPS, K, GROUPS)
        acc += tl.sum(w.to(tl.float32) * xs.to(tl.float32)[None, :, :], 2)
    if USE_GDC:  # every weight read: the next kernel may start (it waits for this one to finish)
        tl.extra.cuda.gdc_launch_dependents()
    out = tl.sum(acc, 1)
    if HAS_BIAS:
        out += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs_n, out.to(y_ptr.dtype.element_ty), mask=n_ok)
