"""FP8 (W8A16, 128x128 block scales) for a few tokens: GEMVs on the CUDA cores, the weights streamed as bytes.

The tensor-core kernels of fp8_linear.py and fp8_moe.py pad a decode row to a 16-row tile and wait on each
weight tile before asking for the next; at one token they reach a quarter of the copy bandwidth (MiniMax-M2's
q_proj: 23%, its MoE: 23%). Here a program owns a strip of BN output rows and one activation row, each
thread two whole 16-byte vectors a step (16 weights and one scale each):

    W rows n..n+BN  | v0 v1 ... v(G-1) | vG ...       acc [BN, G] fp32, a partial sum per vector slot
    x row (bf16)    | 16 16  ...  16   |              (no reduction inside the loop, one at the end)

and loads the next step's vectors (and inputs) before it uses this step's, so four are in flight per thread.
A vector's 16 inputs lie in one 128-input scale block, so its scale is the row's s[n // 128, k // 128] (a
[BN, G] gather that the cache serves). BN is chosen so that the grid has a few
programs per SM even for k_proj's 1,024 rows (`strip`): small N, narrow strips, long steps.

Two entry points, both exact in fp32 up to summation order (e4m3 values are exact in fp32):
  linear_fp8_gemv   y = x @ W^T (+ b) for T rows of x: a program per (row, strip)
  moe_fp8_gemv      the MoE of fp8_moe.py for T * k (token, slot) pairs: a program per (pair, strip), gate/up
                    (bias, activation) -> h, then down (bias, x the routing weight) -> the k parts
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minakv.ops.fp8_tile import check_fp8_weight, expert_shapes
from minakv.ops.moe_groups import ACTIVATIONS, activate_tile, k_parts
from minakv.ops.triton_util import check, num_sms, pdl_options, ptx_loads_ok

THREADS = 128  # 4 warps
VECTORS_PER_THREAD = 2  # 16-byte vectors a thread loads per step (`strip`)

# x_in_asm: one 16-byte vector of e4m3 weights ($1: its address; $3 != 0: it is real, else 0) dotted with its
# 16 bf16 inputs ($2: their address) -> fp32 ($0). The block does its own loads, so no thread needs another's
# activations; `cvt.rn.f16x2.e4m3x2` converts two weights at once (exact), then to fp32.
_E4M3_PAIR = """mov.b32 {{l, h}}, {w};
cvt.rn.f16x2.e4m3x2 c, l; mov.b32 {{e0, e1}}, c; cvt.f32.f16 f0, e0; cvt.f32.f16 f1, e1;
cvt.rn.f16x2.e4m3x2 c, h; mov.b32 {{e0, e1}}, c; cvt.f32.f16 f2, e0; cvt.f32.f16 f3, e1;
shl.b32 a0, {qa}, 16; and.b32 a1, {qa}, 0xFFFF0000; shl.b32 a2, {qb}, 16; and.b32 a3, {qb}, 0xFFFF0000;
fma.rn.f32 s, f0, a0, s; fma.rn.f32 s, f1, a1, s; fma.rn.f32 s, f2, a2, s; fma.rn.f32 s, f3, a3, s;
"""
_DOT16_FP8_PTX = tl.constexpr(
    """{
.reg .pred p;
.reg .b32 w0, w1, w2, w3, q0, q1, q2, q3, q4, q5, q6, q7, c;
.reg .b16 l, h, e0, e1;
.reg .f32 f0, f1, f2, f3, a0, a1, a2, a3, s;
mov.b32 w0, 0; mov.b32 w1, 0; mov.b32 w2, 0; mov.b32 w3, 0;
setp.ne.b32 p, $3, 0;
@p ld.global.nc.v4.b32 {w0, w1, w2, w3}, [$1];
ld.global.nc.v4.b32 {q0, q1, q2, q3}, [$2];
ld.global.nc.v4.b32 {q4, q5, q6, q7}, [$2+16];
mov.f32 s, 0f00000000;
"""
    + "".join(_E4M3_PAIR.format(w=f"w{i}", qa=f"q{2 * i}", qb=f"q{2 * i + 1}") for i in range(4))
    + "mov.b32 $0, s;\n}"
)


def strip(programs_per_row_block: int, out: int, sms: int, widest: int = 16) -> tuple[int, int]:
    """(BN, G): the widest power-of-two strip, at most `widest` rows, that still gives ~4 programs per SM, and
    the vectors per row per step that give each thread two (four in flight with the prefetch). On an H100, one
    token at MiniMax-M2's shapes on distinct weights (bench/gemv_sweep.py): the MoE took 56.7 us at
    16 x 16 against 71.3 at 32 x 4, o_proj 11.2 against 12.5 us; one vector a thread or four were slower."""
    block_n = widest
    while block_n > 1 and programs_per_row_block * triton.cdiv(out, block_n) < 4 * sms:
        block_n //= 2
    return block_n, VECTORS_PER_THREAD * THREADS // block_n


def linear_fp8_gemv(x, weight, scale_inv, bias=None, *, block_n: int | None = None, groups: int | None = None,
                    x_in_asm: bool = False, num_warps: int = 4) -> torch.Tensor:  # fmt: skip
    """x [..., in] @ W^T (+ bias) -> [..., out] in x's dtype (linear_fp8's arguments), for few rows of x.
    x_in_asm: one PTX block loads and dots each vector (bf16 x on the GPU; no prefetch), for benchmarks: at
    two vectors a thread the prefetching form was as fast or faster (bench/gemv_sweep.py)."""
    check_fp8_weight(weight, scale_inv)
    out_features, in_features = weight.shape
    check(
        x.shape[-1] == in_features and in_features % 16 == 0, f"x is {tuple(x.shape)}, weight {weight.shape}"
    )
    lead = x.shape[:-1]
    x = x.reshape(-1, in_features).contiguous()
    rows = x.shape[0]
    auto_n, auto_g = strip(rows, out_features, num_sms(x.device))
    block_n, groups = block_n or auto_n, groups or auto_g
    scale_inv = scale_inv.contiguous()
    y = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    _linear_gemv[(rows, triton.cdiv(out_features, block_n))](
        x, weight, scale_inv, bias if bias is not None else scale_inv, y, out_features, in_features,
        x.stride(0), weight.stride(0), scale_inv.stride(0), y.stride(0), HAS_BIAS=bias is not None,
        BLOCK_N=block_n, GROUPS=groups, X_IN_ASM=ptx_loads_ok(x_in_asm, x), num_warps=num_warps,
        **pdl_options(),
    )  # fmt: skip
    return y.view(*lead, out_features)


def moe_fp8_gemv(x, w, topk_weights, topk_ids, gate_up_bias=None, down_bias=None, activation="silu",
                 limit=7.0, alpha=1.702, *, sum_k: bool = True, block_n: int | None = None,
                 groups: int | None = None, x_in_asm: bool = False, num_warps: int = 4) -> torch.Tensor:  # fmt: skip
    """moe_fp8's function for few pairs -> [T, H] in x's dtype (sum_k=False: the k parts [T, k, H] fp32).
    block_n, groups (vectors per row per step; `strip` picks both) and num_warps are for benchmarks and
    tests."""
    _, hidden, inter = expert_shapes(x, w, topk_ids, activation)
    check(hidden % 16 == 0 and inter % 16 == 0, f"hidden {hidden} and intermediate {inter}: multiples of 16")
    num_tokens, k = topk_ids.shape
    num_pairs = num_tokens * k
    x = x.contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    gu, db = w["gate_up"], w["down"]
    gus, ds = w["gate_up_scale_inv"].contiguous(), w["down_scale_inv"].contiguous()
    dummy = ids
    (n1, g1), (n2, g2) = (strip(num_pairs, size, num_sms(x.device)) for size in (inter, hidden))
    n1, n2 = block_n or n1, block_n or n2
    g1, g2 = groups or g1, groups or g2
    asm = ptx_loads_ok(x_in_asm, x)  # (h, down's input, is allocated here: aligned, x's dtype)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _gate_up_gemv[(num_pairs, triton.cdiv(inter, n1))](
        x, gu, gus, gate_up_bias if gate_up_bias is not None else dummy, ids, h,
        hidden, inter, gus.shape[1] // 2, k, float(limit), float(alpha), x.stride(0), gu.stride(0), gu.stride(1),
        gus.stride(0), gus.stride(1), gate_up_bias.stride(0) if gate_up_bias is not None else 0, h.stride(0),
        HAS_BIAS=gate_up_bias is not None, ACT=ACTIVATIONS[activation], BLOCK_N=n1, GROUPS=g1,
        X_IN_ASM=asm, num_warps=num_warps, **pdl_options(),
    )  # fmt: skip
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _down_gemv[(num_pairs, triton.cdiv(hidden, n2))](
        h, db, ds, down_bias if down_bias is not None else dummy, ids, weights, y, inter, hidden,
        h.stride(0), db.stride(0), db.stride(1), ds.stride(0), ds.stride(1),
        down_bias.stride(0) if down_bias is not None else 0, y.stride(0), HAS_BIAS=down_bias is not None,
        BLOCK_N=n2, GROUPS=g2, X_IN_ASM=asm, num_warps=num_warps, **pdl_options(),
    )  # fmt: skip
    return k_parts(y, num_tokens, k, x.dtype, sum_k)


@triton.jit
def _load(w_rows, s_rows, n_ok, v0, K, GROUPS: tl.constexpr):
    """Vectors v0 .. v0 + G - 1 (inputs 16 v ..) of the rows -> (fp8 [BN, G, 16], their scales [BN, G]);
    0 past K. w_rows: [BN, 1] row pointers; s_rows: [BN] pointers to the rows' scale rows."""
    offs_v = v0 + tl.arange(0, GROUPS)
    ok = n_ok[:, None] & (offs_v < K // 16)[None, :]
    tile = tl.load(w_rows[:, :, None] + offs_v[None, :, None] * 16 + tl.arange(0, 16)[None, None, :],
                   mask=ok[:, :, None], other=0.0)  # fmt: skip
    scale = tl.load(s_rows[:, None] + (offs_v // 8)[None, :], mask=ok, other=0.0)
    return tile, scale


@triton.jit
def _gemv(
    a_row,
    w_rows,
    s_rows,
    n_ok,
    K,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,
    X_IN_ASM: tl.constexpr,
    GDC_WAIT: tl.constexpr = False,
):
    """[BN] fp32: the rows' dot products with a_row over K inputs, the next step's weights and inputs loaded
    before this step's are used (or, X_IN_ASM, each vector loaded and dotted by one PTX block). GDC_WAIT
    (triton_util.PDL): wait for the kernel before only once the first weights are asked for (no kernel
    writes weights; a_row may be its output)."""
    acc = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    if X_IN_ASM:
        if GDC_WAIT:
            tl.extra.cuda.gdc_wait()
        for v0 in range(0, K // 16, GROUPS):
            offs_v = v0 + tl.arange(0, GROUPS)
            ok = n_ok[:, None] & (offs_v < K // 16)[None, :]
            w_addr = (w_rows + offs_v[None, :] * 16).to(tl.int64)
            # past K: any inputs of the row (the vector's weights read as 0)
            x_addr = (a_row + tl.minimum(offs_v, K // 16 - 1)[None, :] * 16).to(tl.int64)
            part = tl.inline_asm_elementwise(
                _DOT16_FP8_PTX, "=r,l,l,r", [w_addr, tl.broadcast_to(x_addr, w_addr.shape), ok.to(tl.int32)],
                dtype=tl.float32, is_pure=True, pack=1,
            )  # fmt: skip
            acc += part * tl.load(s_rows[:, None] + (offs_v // 8)[None, :], mask=ok, other=0.0)
    else:
        tile_next, scale_next = _load(w_rows, s_rows, n_ok, 0, K, GROUPS)
        if GDC_WAIT:
            tl.extra.cuda.gdc_wait()
        a_next = tl.load(a_row + tl.arange(0, GROUPS)[:, None] * 16 + tl.arange(0, 16)[None, :],
                         mask=(tl.arange(0, GROUPS) < K // 16)[:, None], other=0.0)  # fmt: skip
        for v0 in range(0, K // 16, GROUPS):
            tile, scale, a = tile_next, scale_next, a_next
            tile_next, scale_next = _load(w_rows, s_rows, n_ok, v0 + GROUPS, K, GROUPS)
            offs_v = v0 + GROUPS + tl.arange(0, GROUPS)
            a_next = tl.load(a_row + offs_v[:, None] * 16 + tl.arange(0, 16)[None, :],
                             mask=(offs_v < K // 16)[:, None], other=0.0)  # fmt: skip
            acc += tl.sum(tile.to(tl.float32) * a.to(tl.float32)[None, :, :], 2) * scale
    return tl.sum(acc, 1)


@triton.jit
def _strip(w_ptr, s_ptr, N, stride_wn, stride_sn, BLOCK_N: tl.constexpr):
    """This program's output rows (program_id(1)): offsets, which are < N, weight row and scale row pointers."""
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    return offs_n, offs_n < N, w_rows, s_ptr + (offs_n // 128) * stride_sn


@triton.jit
def _linear_gemv(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, N, K, stride_x, stride_wn, stride_sn, stride_y,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
                 X_IN_ASM: tl.constexpr, USE_GDC: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs_n, n_ok, w_rows, s_rows = _strip(w_ptr, s_ptr, N, stride_wn, stride_sn, BLOCK_N)
    out = _gemv(x_ptr + row * stride_x, w_rows, s_rows, n_ok, K, BLOCK_N, GROUPS, X_IN_ASM, GDC_WAIT=USE_GDC)
    if USE_GDC:  # every weight read: the next kernel may start (it waits for this one to finish)
        tl.extra.cuda.gdc_launch_dependents()
    if HAS_BIAS:
        out += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs_n, out.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _gate_up_gemv(
    x_ptr, w_ptr, s_ptr, b_ptr, ids_ptr, h_ptr, H, I, UP_SCALE_ROW, TOPK, limit, alpha,
    stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_bias, stride_h,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
    X_IN_ASM: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0)
    if USE_GDC:  # (triton_util.PDL) the ids and x are the kernels' before
        tl.extra.cuda.gdc_wait()
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    w_e, s_e = w_ptr + expert * stride_we, s_ptr + expert * stride_se
    offs_n, n_ok, gate_rows, gate_s = _strip(w_e, s_e, I, stride_wn, stride_sn, BLOCK_N)
    # up rows I + n, with their own scale grid from row UP_SCALE_ROW (fp8_tile's layout)
    up_rows, up_s = gate_rows + I * stride_wn, gate_s + UP_SCALE_ROW * stride_sn
    x_row = x_ptr + (pair // TOPK).to(tl.int64) * stride_x
    gate = _gemv(x_row, gate_rows, gate_s, n_ok, H, BLOCK_N, GROUPS, X_IN_ASM)[None, :]
    up = _gemv(x_row, up_rows, up_s, n_ok, H, BLOCK_N, GROUPS, X_IN_ASM)[None, :]
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    if HAS_BIAS:
        gate += tl.load(b_ptr + expert * stride_bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(b_ptr + expert * stride_bias + I + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    act = activate_tile(gate, up, limit, alpha, ACT)
    h_row = h_ptr + pair.to(tl.int64) * stride_h
    tl.store(h_row + offs_n[None, :], act.to(h_ptr.dtype.element_ty), mask=n_ok[None, :])


@triton.jit
def _down_gemv(
    h_ptr, w_ptr, s_ptr, b_ptr, ids_ptr, weights_ptr, y_ptr, I, H,
    stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_bias, stride_y,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, X_IN_ASM: tl.constexpr,
    USE_GDC: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0)
    if USE_GDC:  # (triton_util.PDL) h is the kernel before's
        tl.extra.cuda.gdc_wait()
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    offs_n, n_ok, w_rows, s_rows = _strip(w_ptr + expert * stride_we, s_ptr + expert * stride_se, H, stride_wn,
                                          stride_sn, BLOCK_N)  # fmt: skip
    out = _gemv(h_ptr + pair.to(tl.int64) * stride_h, w_rows, s_rows, n_ok, I, BLOCK_N, GROUPS, X_IN_ASM)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    if HAS_BIAS:
        out += tl.load(b_ptr + expert * stride_bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    out *= tl.load(weights_ptr + pair)
    tl.store(y_ptr + pair.to(tl.int64) * stride_y + offs_n, out, mask=n_ok)
