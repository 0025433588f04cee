"""MXFP4 MoE for a few tokens: one GEMV per (token, slot) pair on the CUDA cores, weights streamed packed.

At a batch of one a decode step's MoE reads 4 experts' packed weights (~50 MB at gpt-oss's shapes) and
multiplies each weight once. The tensor-core kernels of mxfp4_moe.py pad that one row to a 16-row tile and,
with their dequantized tiles in registers, keep 2-3 programs per SM: ~8 KB in flight per SM, so the
memory latency, not its bandwidth, sets the pace (12% of copy bandwidth on the H200). Here the work is
shaped for bytes in flight instead:

    program (pair p, rows n .. n + BN of its expert's weight W [out, in])
    thread  whole 16-byte groups: 32 weights, one vector load, one scale byte
                  W rows n..n+BN   | g0 g1 ... g(G-1) | g(G) ...        acc [BN, G] fp32, per group
                  x[p] (or h[p])   | 32 32  ...  32   |                 (no reduction inside the loop)
    loop    over the input in steps of G groups: load G groups of every row, decode, multiply-add into
            acc; one sum over G at the end -> BN outputs

Two kernels, as in the tensor-core path: gate/up (both halves' rows, bias, the activation) -> h [P, I] in
x's dtype, then down (h @ W^T, bias, x the pair's routing weight) -> y [P, H] in fp32, summed over each
token's k slots by the caller (or by add_rms_norm). A pair's expert is read once per pair, so an expert
chosen by several pairs is read several times: `moe_mxfp4` takes this path only while the pairs are few
next to the experts (see FEW_PAIRS there).

Decoding. A byte holds two E2M1 codes, the low nibble the even input. The code's bits e1 e0 m0 put right
under fp16's exponent, and its sign on fp16's, make an fp16 equal to the FP4 value times 2^-14 (the 0.5
code lands on an fp16 subnormal, exact); the 2^14 goes into the group's scale, 2^(s - 127 + 14). On the GPU
this runs as inline PTX on 4 bytes at a time: two `prmt` spread bytes 0,1 and 2,3 over the two halves of a
register, then a shift and a mask per nibble position turn each register into two fp16 (about 1.75
instructions per weight, against 6 for the same arithmetic per element). The interpreter, which has no
inline assembly, runs the same arithmetic per element (mxfp4_tile.e2m1_f16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minakv.ops.moe_groups import ACTIVATIONS, activate_tile
from minakv.ops.mxfp4_tile import e2m1_f16, packed_shapes
from minakv.ops.triton_util import interpreting

# 4 bytes in ($4); out: the low nibbles of bytes (0, 1), (2, 3) as fp16 pairs ($0, $1), the high ones ($2, $3)
_DECODE_PTX = tl.constexpr(
    """
{
.reg .b32 t01, t23, a, b;
prmt.b32 t01, $4, 0, 0x4140;
prmt.b32 t23, $4, 0, 0x4342;
shl.b32 a, t01, 9;   and.b32 a, a, 0x0E000E00;  shl.b32 b, t01, 12;  and.b32 b, b, 0x80008000;  or.b32 $0, a, b;
shl.b32 a, t23, 9;   and.b32 a, a, 0x0E000E00;  shl.b32 b, t23, 12;  and.b32 b, b, 0x80008000;  or.b32 $1, a, b;
shl.b32 a, t01, 5;   and.b32 a, a, 0x0E000E00;  shl.b32 b, t01, 8;   and.b32 b, b, 0x80008000;  or.b32 $2, a, b;
shl.b32 a, t23, 5;   and.b32 a, a, 0x0E000E00;  shl.b32 b, t23, 8;   and.b32 b, b, 0x80008000;  or.b32 $3, a, b;
}
"""
)


def moe_mxfp4_gemv(x, w, topk_weights, topk_ids, gate_up_bias=None, down_bias=None, activation="silu",
                   limit=7.0, alpha=1.702, *, sum_k: bool = True, block_n: int = 16, groups: int = 8,
                   num_warps: int = 4) -> torch.Tensor:  # fmt: skip
    """Sum over each token's k experts of weight * expert(x) -> [T, H] in x's dtype (sum_k=False: the k
    parts [T, k, H] in fp32), the experts packed (moe_mxfp4's arguments). block_n rows and `groups` groups
    of 32 inputs per program and step are for benchmarks and tests (powers of two)."""
    num_experts, hidden, inter = packed_shapes(x, w, topk_ids, activation)
    num_tokens, k = topk_ids.shape
    num_pairs = num_tokens * k
    x = x.contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    dummy = ids  # any pointer, for absent biases
    gub, gus, db, ds = (w[key] for key in ("gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales"))
    meta = {"BLOCK_N": block_n, "GROUPS": groups, "ASM": not interpreting(), "num_warps": num_warps}
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _gate_up_gemv[(num_pairs, triton.cdiv(inter, block_n))](
        x, gub, gus, gate_up_bias if gate_up_bias is not None else dummy, ids, h,
        hidden, inter, k, float(limit), float(alpha), x.stride(0), gub.stride(0), gub.stride(1), gus.stride(0),
        gus.stride(1), gate_up_bias.stride(0) if gate_up_bias is not None else 0, h.stride(0),
        HAS_BIAS=gate_up_bias is not None, ACT=ACTIVATIONS[activation], **meta,
    )  # fmt: skip
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _down_gemv[(num_pairs, triton.cdiv(hidden, block_n))](
        h, db, ds, down_bias if down_bias is not None else dummy, ids, weights, y,
        inter, hidden, h.stride(0), db.stride(0), db.stride(1), ds.stride(0), ds.stride(1),
        down_bias.stride(0) if down_bias is not None else 0, y.stride(0), HAS_BIAS=down_bias is not None, **meta,
    )  # fmt: skip
    if not sum_k:  # the caller's add_rms_norm sums the k parts (minakv/ops/norm.py)
        return y.view(num_tokens, k, hidden)
    return y.view(num_tokens, k, hidden).sum(1).to(x.dtype)


@triton.jit
def _decode(packed, ASM: tl.constexpr):
    """Packed bytes [..., 16] -> (even, odd) inputs as fp16 equal to the FP4 values times 2^-14."""
    if ASM:
        even, odd = tl.inline_asm_elementwise(
            _DECODE_PTX, "=r,=r,=r,=r,r", [packed], dtype=(tl.float16, tl.float16), is_pure=True, pack=4
        )
    else:
        even, odd = e2m1_f16(packed & 0xF), e2m1_f16(packed >> 4)
    return even, odd


@triton.jit
def _rows(
    blocks_ptr, scales_ptr, expert, N, stride_be, stride_bn, stride_se, stride_sn, BLOCK_N: tl.constexpr
):
    """This program's output rows of the expert's weight: (offsets, which are < N, [BN, 1] row pointers to
    the bytes and to the scales)."""
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    e = expert.to(tl.int64)
    byte_rows = blocks_ptr + e * stride_be + offs_n[:, None] * stride_bn
    scale_rows = scales_ptr + e * stride_se + offs_n[:, None] * stride_sn
    return offs_n, offs_n < N, byte_rows, scale_rows


@triton.jit
def _step(a_row, byte_rows, scale_rows, n_ok, g0, num_groups, acc, GROUPS: tl.constexpr, ASM: tl.constexpr):
    """acc [BN, G] + per-group partial dot products of inputs [g0 * 32, (g0 + G) * 32) of a_row (one row of
    activations) with the rows' weights, in fp32."""
    offs_g = g0 + tl.arange(0, GROUPS)
    g_ok = offs_g < num_groups
    ok = n_ok[:, None] & g_ok[None, :]
    ptrs = byte_rows[:, :, None] + offs_g[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
    packed = tl.load(ptrs, mask=ok[:, :, None], other=0)  # [BN, G, 16]: one 16-byte vector per group
    s = tl.load(scale_rows + offs_g[None, :], mask=ok, other=0).to(tl.uint32) + 14  # 2^(s - 127) * 2^14
    scale = (s << 23).to(tl.float32, bitcast=True)
    a = tl.load(a_row + offs_g[:, None] * 32 + tl.arange(0, 32)[None, :], mask=g_ok[:, None], other=0.0)
    a_even, a_odd = tl.split(tl.reshape(a.to(tl.float32), (GROUPS, 16, 2)))
    even, odd = _decode(packed, ASM)
    part = tl.sum(even.to(tl.float32) * a_even[None, :, :] + odd.to(tl.float32) * a_odd[None, :, :], 2)
    return acc + part * scale


@triton.jit
def _gate_up_gemv(
    x_ptr, wb_ptr, ws_ptr, b_ptr, ids_ptr, h_ptr, H, I, TOPK, limit, alpha,
    stride_x, stride_be, stride_bn, stride_se, stride_sn, stride_bias, stride_h,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair)
    offs_n, n_ok, gate_b, gate_s = _rows(wb_ptr, ws_ptr, expert, I, stride_be, stride_bn, stride_se, stride_sn,
                                         BLOCK_N)  # fmt: skip
    up_b, up_s = gate_b + I * stride_bn, gate_s + I * stride_sn  # up rows I + n: the same columns of h
    x_row = x_ptr + (pair // TOPK).to(tl.int64) * stride_x
    acc_gate = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    for g0 in range(0, H // 32, GROUPS):
        acc_gate = _step(x_row, gate_b, gate_s, n_ok, g0, H // 32, acc_gate, GROUPS, ASM)
        acc_up = _step(x_row, up_b, up_s, n_ok, g0, H // 32, acc_up, GROUPS, ASM)
    gate = tl.sum(acc_gate, 1)[None, :]
    up = tl.sum(acc_up, 1)[None, :]
    if HAS_BIAS:
        bias_row = b_ptr + expert.to(tl.int64) * stride_bias
        gate += tl.load(bias_row + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(bias_row + I + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    act = activate_tile(gate, up, limit, alpha, ACT)
    h_row = h_ptr + pair.to(tl.int64) * stride_h
    tl.store(h_row + offs_n[None, :], act.to(h_ptr.dtype.element_ty), mask=n_ok[None, :])


@triton.jit
def _down_gemv(
    h_ptr, wb_ptr, ws_ptr, b_ptr, ids_ptr, weights_ptr, y_ptr, I, H,
    stride_h, stride_be, stride_bn, stride_se, stride_sn, stride_bias, stride_y,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair)
    offs_n, n_ok, w_b, w_s = _rows(
        wb_ptr, ws_ptr, expert, H, stride_be, stride_bn, stride_se, stride_sn, BLOCK_N
    )
    h_row = h_ptr + pair.to(tl.int64) * stride_h
    acc = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    for g0 in range(0, I // 32, GROUPS):
        acc = _step(h_row, w_b, w_s, n_ok, g0, I // 32, acc, GROUPS, ASM)
    out = tl.sum(acc, 1)
    if HAS_BIAS:
        out += tl.load(b_ptr + expert.to(tl.int64) * stride_bias + offs_n, mask=n_ok, other=0.0).to(
            tl.float32
        )
    out *= tl.load(weights_ptr + pair)
    tl.store(y_ptr + pair.to(tl.int64) * stride_y + offs_n, out, mask=n_ok)
