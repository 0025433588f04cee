"""FP8 e4m3 weights with 128x128 block scales, dequantized in registers: what the FP8 linear (fp8_linear.py)
and the FP8 MoE (fp8_moe.py, fp8_grouped.py) share.

The layout, MiniMax-M2's checkpoint format (minakv/ops/quant.py), for a weight W [out, in]:

    weight     float8_e4m3fn [out, in]              one byte per weight
    scale_inv  f32 [ceil(out/128), ceil(in/128)]    one multiplier per 128 x 128 block (not an inverse!)

                 in:  0 ....... 127 | 128 ...... 255 | 256 .. 299     (in = 300: a ragged last block)
          out    0 +----------------+----------------+-----------+
                   |    s[0, 0]     |    s[0, 1]     |  s[0, 2]  |
               128 +----------------+----------------+-----------+
                   |    s[1, 0]     |    s[1, 1]     |  s[1, 2]  |
               200 +----------------+----------------+-----------+   (out = 200: a ragged last row of blocks)

    W[n, k] = float(weight[n, k]) * scale_inv[n // 128, k // 128]

A kernel walks K in steps of BLOCK_K, a divisor of 128, so a step never straddles two scale columns: output
row n of the step has ONE scale, s[n // 128, k0 // 128]. So the block is never dequantized element by
element; the raw FP8 tile goes into the dot and the scale is applied to the dot's fp32 result:

    acc[m, n] += (x[m, k0:k0+BK] @ Wq[n, k0:k0+BK]^T) * s[n // 128, k0 // 128]        (`scaled_dot`)

Every e4m3 value is exactly a bf16 (and an fp16), so the FP8 -> bf16 conversion in registers is exact and
the only roundings are the dot's: the result is closer to the true product than a bf16 matmul on
dequantized (bf16-rounded) weights. The scales are a [BLOCK_N] gather of (mostly) one address per step.

MoE experts stack such weights: gate_up [E, 2I, H] is the gate rows (w1) then the up rows (w3), each
with its own scale grid, so gate_up_scale_inv is [E, 2 * ceil(I/128), ceil(H/128)] (the up half's scale rows
start at ceil(I/128): when I is a multiple of 128, as MiniMax-M2's 1536, that is just the stacked grid);
down [E, H, I] with down_scale_inv [E, ceil(H/128), ceil(I/128)].
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from minakv.ops.moe_groups import ACTIVATIONS
from minakv.ops.quant import dequantize_fp8_block, quantize_fp8_block
from minakv.ops.triton_util import check, interpreting

BLOCK = 128  # the checkpoint's scale block, both ways
KEYS = ("gate_up", "gate_up_scale_inv", "down", "down_scale_inv")


def check_fp8_weight(weight: torch.Tensor, scale_inv: torch.Tensor, name: str = "weight") -> None:
    """An FP8 weight [..., out, in] with its block scales [..., ceil(out/128), ceil(in/128)], in the layout the
    kernels read (unit stride along `in`, scales fp32)."""
    check(weight.dtype == torch.float8_e4m3fn, f"{name} must be float8_e4m3fn, got {weight.dtype}")
    check(scale_inv.dtype == torch.float32, f"{name} scales must be float32, got {scale_inv.dtype}")
    check(weight.stride(-1) == 1, f"{name} must be contiguous along its input dim, strides {weight.stride()}")
    out, inp = weight.shape[-2:]
    grid = (*weight.shape[:-2], math.ceil(out / BLOCK), math.ceil(inp / BLOCK))
    check(tuple(scale_inv.shape) == grid, f"{name} scales are {tuple(scale_inv.shape)}, expected {grid}")


def expert_shapes(x: torch.Tensor, w: dict[str, torch.Tensor], topk_ids: torch.Tensor, activation: str):
    """Validate FP8 experts (keys KEYS, layout in the module docstring) against x -> (E, H, I)."""
    check(
        activation in ACTIVATIONS, f"unknown MoE activation {activation!r} (expected 'silu' or 'swiglu_oai')"
    )
    missing = [key for key in KEYS if key not in w]
    check(not missing, f"FP8 experts lack {missing} (expected keys {KEYS})")
    gate_up, down = w["gate_up"], w["down"]
    check(gate_up.dim() == 3 and down.dim() == 3, "FP8 expert weights must be [E, out, in]")
    num_experts, two_i, hidden = gate_up.shape
    inter = two_i // 2
    check(x.dim() == 2 and x.shape[1] == hidden, f"x is {tuple(x.shape)}, expected [T, {hidden}]")
    check(down.shape == (num_experts, hidden, inter), f"down is {tuple(down.shape)}")
    scale = w["gate_up_scale_inv"]
    halves = (num_experts, 2 * math.ceil(inter / BLOCK), math.ceil(hidden / BLOCK))
    check(
        tuple(scale.shape) == halves,
        f"gate_up_scale_inv is {tuple(scale.shape)}, expected {halves} (a scale grid for each of the gate "
        "and up halves)",
    )
    check_fp8_weight(gate_up[:, :inter], scale[:, : halves[1] // 2], "gate_up")
    check_fp8_weight(down, w["down_scale_inv"], "down")
    check(topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0], f"topk_ids is {tuple(topk_ids.shape)}")
    return num_experts, hidden, inter


def quantize_experts(w: torch.Tensor, halves: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """W [E, out, in] -> (fp8 [E, out, in], scales): per expert, per half (gate_up) when `halves`."""
    parts = w.chunk(2, dim=1) if halves else (w,)
    quantized = [[quantize_fp8_block(expert) for expert in part] for part in parts]
    weight = torch.cat([torch.stack([q for q, _ in part]) for part in quantized], dim=1)
    scale = torch.cat([torch.stack([s for _, s in part]) for part in quantized], dim=1)
    return weight, scale


def dequantize_experts(
    weight: torch.Tensor, scale_inv: torch.Tensor, halves: bool = False, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """fp8 [E, out, in] + scales -> W [E, out, in] in dtype (the inverse of quantize_experts)."""
    parts = zip(weight.chunk(2, dim=1), scale_inv.chunk(2, dim=1)) if halves else [(weight, scale_inv)]
    deq = [torch.stack([dequantize_fp8_block(q, s, BLOCK, dtype) for q, s in zip(*part)]) for part in parts]
    return torch.cat(deq, dim=1)


def f32_dot(x: torch.Tensor) -> bool:
    """Whether the kernels take the fp32 dot: fp32 activations, or the interpreter (which multiplies bf16
    dots wrongly, see triton_util.interpreting). Otherwise the FP8 tile goes into the dot as x's dtype."""
    return x.dtype == torch.float32 or interpreting()


@triton.jit
def fp8_rows(w_ptr, s_ptr, n0, N, stride_wn, stride_sn, BLOCK_N: tl.constexpr):
    """Output rows n0 .. n0 + BLOCK_N - 1 of a weight (w_ptr, s_ptr: its first byte and first scale), and
    which are < N: [BLOCK_N, 1] pointers to their weight rows, [BLOCK_N] pointers to their scale rows."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + (offs_n // 128) * stride_sn
    return offs_n, offs_n < N, w_rows, s_rows


@triton.jit
def scaled_dot(a, w_rows, s_rows, row_ok, k0, K, acc, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr):
    """acc + a @ W[rows, k0 : k0 + BLOCK_K]^T for a [BM, BLOCK_K] activation tile a: the raw FP8 tile in the
    dot, its rows' block scales on the fp32 result. Inputs past K read 0."""
    tl.static_assert(128 % BLOCK_K == 0, "BLOCK_K must divide the 128-wide scale block")
    offs_k = k0 + tl.arange(0, BLOCK_K)
    q = tl.load(w_rows + offs_k[None, :], mask=row_ok[:, None] & (offs_k < K)[None, :], other=0.0)
    scale = tl.load(s_rows + k0 // 128, mask=row_ok, other=0.0)
    if F32_DOT:  # fp32 activations (or the interpreter): exact fp32 products, not tf32
        part = tl.dot(a.to(tl.float32), tl.trans(q.to(tl.float32)), input_precision="ieee")
    else:  # e4m3 -> bf16 / fp16 is exact
        part = tl.dot(a, tl.trans(q.to(a.dtype)))
    return acc + part * scale[None, :]
