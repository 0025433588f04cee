"""MXFP4 MoE for a few tokens: one GEMV per (token, slot) pair on the CUDA cores, weights streamed packed.

At a batch of one a decode step's MoE reads 4 experts' packed weights (~50 MB at gpt-oss's shapes) and
multiplies each weight once. The fused kernels of mxfp4_fused.py pad that one row to a 16-row tile and
read at ~12% of copy bandwidth on the H200; this path reads at twice that (bench/RESULTS.md, "GEMVs for few
pairs"). On the GPU `moe_mxfp4` asks for `mma=True`: the same GEMV on the tensor cores (mxfp4_mma.py, ~2.5
instructions a weight against ~5 here), faster still; this CUDA-core form is the interpreter's:

    program (pair p, rows n .. n + BN of its expert's weight W [out, in], split s of the input)
    thread  whole 16-byte groups: 32 weights, one vector load (4 words), one scale byte
                  W rows n..n+BN   | g0 g1 ... g(G-1) | g(G) ...        acc [BN, G] fp32, per group
                  x[p] (or h[p])   | 32 32  ...  32   |                 (no reduction inside the loop)
    loop    over the split's inputs in steps of G groups: decode and multiply-add into acc, after loading
            the next step's words and inputs; one sum over G at the end -> BN outputs

Two kernels, as in the tensor-core path: gate/up (both halves' rows, bias, the activation) -> h [P, I] in
x's dtype, then down (h @ W^T, bias, x the pair's routing weight) -> y [P, H] in fp32, summed over each
token's k slots by the caller (or by add_rms_norm). With split-K, gate/up store fp32 partials that
`gate_up_finish` sums, and down's splits come back as extra parts. A pair's expert is read once per pair,
so an expert chosen by several pairs is read several times: `moe_mxfp4` takes this path only while the
pairs are no more than the experts.

Decoding: on the GPU one inline-PTX block per 32-bit word (mxfp4_ptx.py) turns its 8 codes into fp16
equal to the FP4 values times 2^-14, two at a time, and does the 8 multiply-adds in fp32; the 2^14 goes
into the group's scale, 2^(s - 127 + 14). The interpreter, which has no inline assembly, runs the same
arithmetic per code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minakv.ops.moe_groups import ACTIVATIONS, activate_tile, k_parts
from minakv.ops.mxfp4_layout import group_offsets, row_starts, scale_offsets
from minakv.ops.mxfp4_mma import moe_mxfp4_mma
from minakv.ops.mxfp4_order import pair_position
from minakv.ops.mxfp4_ptx import dot8, dot8_load
from minakv.ops.mxfp4_tile import packed_shapes, split_col
from minakv.ops.triton_util import interpreting, ptx_loads_ok


def moe_mxfp4_gemv(x, w, topk_weights, topk_ids, gate_up_bias=None, down_bias=None, activation="silu",
                   limit=7.0, alpha=1.702, *, sum_k: bool = True, block_n: int = 16, groups: int = 8,
                   num_warps: int = 4, splits: int = 1, x_in_asm: bool = False, mma: bool = False,
                   x16: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Sum over each token's k experts of weight * expert(x) -> [T, H] in x's dtype (sum_k=False: the k
    parts [T, k, H] in fp32), the experts packed (moe_mxfp4's arguments). block_n rows and `groups` groups
    of 32 inputs per program and step are for benchmarks and tests (powers of two). splits: programs along
    the input per strip (split-K: shorter chains of dependent steps); gate/up then store fp32 partials that
    `gate_up_finish` sums (bias, activation), down returns its parts as extra slots [T, k * splits, H].
    x_in_asm: the PTX block loads each word's inputs itself (bf16 activations on the GPU): 8% faster at one
    token's pairs with 4 x 32 strips, no gain elsewhere (mxfp4_moe.gemv_config). Rows in expert order (so
    that an expert's repeat reads hit L2) were tried and lost at 1, 8 and 64 tokens (bench/RESULTS.md).
    mma: the tensor-core GEMV of mxfp4_mma.py instead (compiled runs only; mxfp4_moe.gemv_config), which
    reads x16 if given (x in pair order, mxfp4_order.py). The weights in tiles (mxfp4_layout.py)."""
    _, hidden, inter = packed_shapes(x, w, topk_ids, activation)
    if mma and not interpreting():
        return moe_mxfp4_mma(x, w, topk_weights, topk_ids, gate_up_bias, down_bias, activation, limit, alpha,
                             sum_k=sum_k, x16=x16)  # fmt: skip
    num_tokens, k = topk_ids.shape
    num_pairs = num_tokens * k
    x = x.contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    dummy = ids  # any pointer, for absent biases
    gub, gus, db, ds = (w[key] for key in ("gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales"))
    gub, db = gub.view(torch.int32), db.view(torch.int32)  # a group's 16 bytes as 4 words [E, out, in/32, 4]
    asm = not interpreting()
    meta = {"BLOCK_N": block_n, "GROUPS": groups, "ASM": asm, "SPLITS": splits, "num_warps": num_warps,
            "X_IN_ASM": ptx_loads_ok(x_in_asm, x)}  # fmt: skip
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    # with split-K gate/up write fp32 partials [splits, pairs, gate I | up I] instead of h
    partial = (
        torch.empty(splits, num_pairs, 2 * inter, dtype=torch.float32, device=x.device) if splits > 1 else h
    )
    _gate_up_gemv[(num_pairs, triton.cdiv(inter, block_n), splits)](
        x, gub, gus, gate_up_bias if gate_up_bias is not None else dummy, ids, partial, hidden, inter, k, float(limit), float(alpha),
        k_per_split(hidden, 32 * groups, splits) // 32, x.stride(0), gub.stride(0), gub.stride(1), gus.stride(0),
        gus.stride(1), gate_up_bias.stride(0) if gate_up_bias is not None else 0, partial.stride(-2), HAS_BIAS=gate_up_bias is not None,
        ACT=ACTIVATIONS[activation], **meta,
    )  # fmt: skip
    if splits > 1:
        finish_gate_up(partial, gate_up_bias, ids, h, activation, limit, alpha, cols=0)
    # down: row pair * splits + s holds split s's part, so the parts of a token stay together
    y = torch.empty(num_pairs * splits, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _down_gemv[(num_pairs, triton.cdiv(hidden, block_n), splits)](
        h, db, ds, down_bias if down_bias is not None else dummy, ids, weights, y, inter, hidden,
        k_per_split(inter, 32 * groups, splits) // 32, h.stride(0), db.stride(0), db.stride(1), ds.stride(0),
        ds.stride(1), down_bias.stride(0) if down_bias is not None else 0, y.stride(0),
        HAS_BIAS=down_bias is not None, **meta,
    )  # fmt: skip
    return k_parts(y, num_tokens, k * splits, x.dtype, sum_k)


def finish_gate_up(partial: torch.Tensor, gate_up_bias: torch.Tensor | None, ids: torch.Tensor, h: torch.Tensor,
                   activation: str, limit: float, alpha: float, cols: int) -> None:  # fmt: skip
    """Split-K's end for gate/up (here, in mxfp4_fused.py and mxfp4_mma.py): `gate_up_finish` over the fp32
    partials [splits, pairs, gate I | up I] -> h [pairs, I], its columns in the order `cols` (see there)."""
    splits, num_pairs, two_i = partial.shape
    gate_up_finish[(num_pairs, triton.cdiv(two_i // 2, 256))](
        partial, gate_up_bias if gate_up_bias is not None else ids, ids, h, num_pairs, two_i // 2, float(limit),
        float(alpha), gate_up_bias.stride(0) if gate_up_bias is not None else 0, h.stride(0),
        HAS_BIAS=gate_up_bias is not None, ACT=ACTIVATIONS[activation], COLS=cols, SPLITS=splits,
        BLOCK=256,
    )  # fmt: skip


def k_per_split(size: int, block_k: int, splits: int) -> int:
    """Inputs each of `splits` programs covers (here and in mxfp4_fused.py): whole steps of block_k inputs (so
    whole MXFP4 groups), as even as can be."""
    return triton.cdiv(triton.cdiv(size, block_k), splits) * block_k


@triton.jit
def _rows(blocks_ptr, scales_ptr, expert, N, stride_be, stride_bn, stride_se, stride_sn,
          BLOCK_N: tl.constexpr):  # fmt: skip
    """This program's output rows of the expert's weight: (offsets, which are < N, [BN, 1] row pointers to
    the words and to the scales)."""
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    words, scales = row_starts(blocks_ptr, scales_ptr, expert, offs_n, stride_be, stride_bn, stride_se,
                               stride_sn, 4)  # fmt: skip
    return offs_n, offs_n < N, words[:, None], scales[:, None]


@triton.jit
def _load(word_rows, scale_rows, n_ok, g0, num_groups, GROUPS: tl.constexpr):
    """The rows' packed words [BN, G, 4] (a group's 16 bytes: one vector load) and group scales [BN, G]
    (fp32 2^(s - 127) * 2^14) for inputs [g0 * 32, (g0 + G) * 32); 0 past the end."""
    offs_g = g0 + tl.arange(0, GROUPS)
    ok = n_ok[:, None] & (offs_g < num_groups)[None, :]
    ptrs = word_rows[:, :, None] + group_offsets(offs_g, 4)[None, :, None] + tl.arange(0, 4)[None, None, :]
    words = tl.load(ptrs, mask=ok[:, :, None], other=0)
    s = tl.load(scale_rows + scale_offsets(offs_g)[None, :], mask=ok, other=0).to(tl.uint32) + 14
    return words, (s << 23).to(tl.float32, bitcast=True)


@triton.jit
def _load_act(a_row, g0, num_groups, GROUPS: tl.constexpr, X_IN_ASM: tl.constexpr):
    """Inputs [g0 * 32, (g0 + G) * 32) of a_row (one row of activations) as [G, 4 words, 8]; 0 past the end.
    With X_IN_ASM the PTX block loads them itself: a placeholder."""
    if X_IN_ASM:
        a = tl.zeros((1, 1, 1), dtype=a_row.dtype.element_ty)
    else:
        offs_g = g0 + tl.arange(0, GROUPS)
        offs = (
            offs_g[:, None, None] * 32 + tl.arange(0, 4)[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
        )
        a = tl.load(a_row + offs, mask=(offs_g < num_groups)[:, None, None], other=0.0)
    return a


@triton.jit
def _acc(a_row, a, g0, g_hi, words, scale, acc, GROUPS: tl.constexpr, ASM: tl.constexpr,
         X_IN_ASM: tl.constexpr):  # fmt: skip
    """acc [BN, G] + the per-group partial dot products of a loaded step (`_load`, `_load_act`), in fp32."""
    if X_IN_ASM:  # each word's 8 bf16 inputs loaded by the PTX block from their address (past g_hi: any
        # inputs in the row, times the 0 codes of the masked words)
        offs_g = tl.minimum(g0 + tl.arange(0, GROUPS), g_hi - 1)
        addr = a_row + offs_g[:, None] * 32 + tl.arange(0, 4)[None, :] * 8
        addr = tl.broadcast_to(addr[None, :, :], words.shape).to(tl.int64)
        part = dot8_load(words, addr)
    else:
        # input m of each word (a's last dim, m = 4 m2 + 2 m1 + m0), each [G, 4]
        a0, a1 = tl.split(tl.reshape(a.to(tl.float32), (GROUPS, 4, 2, 2, 2)))  # m0 = 0 / 1: [G, 4, 2, 2]
        a00, a01 = tl.split(a0)  # m1 = 0 / 1: [G, 4, 2 (m2)]
        a10, a11 = tl.split(a1)
        x0, x4 = tl.split(a00)
        x2, x6 = tl.split(a01)
        x1, x5 = tl.split(a10)
        x3, x7 = tl.split(a11)
        part = dot8(
            words, x0[None], x1[None], x2[None], x3[None], x4[None], x5[None], x6[None], x7[None], ASM
        )
    return acc + tl.sum(part, 2) * scale


@triton.jit
def _gate_up_gemv(
    x_ptr, wb_ptr, ws_ptr, b_ptr, ids_ptr, h_ptr, H, I, TOPK, limit, alpha, G_SPLIT,
    stride_x, stride_be, stride_bn, stride_se, stride_sn, stride_bias, stride_h,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, ASM: tl.constexpr,
    SPLITS: tl.constexpr, X_IN_ASM: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair)
    offs_n, n_ok, gate_b, gate_s = _rows(wb_ptr, ws_ptr, expert, I, stride_be, stride_bn, stride_se, stride_sn,
                                         BLOCK_N)  # fmt: skip
    up_b, up_s = gate_b + I * stride_bn, gate_s + I * stride_sn  # up rows I + n: the same columns of h
    x_row = x_ptr + (pair // TOPK).to(tl.int64) * stride_x
    acc_gate = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    g_lo = tl.program_id(2) * G_SPLIT
    g_hi = tl.minimum(g_lo + G_SPLIT, H // 32)
    # the next step's weights and inputs are loaded before this step's are used: two steps in flight
    gate_next, gate_sc_next = _load(gate_b, gate_s, n_ok, g_lo, g_hi, GROUPS)
    up_next, up_sc_next = _load(up_b, up_s, n_ok, g_lo, g_hi, GROUPS)
    x_next = _load_act(x_row, g_lo, g_hi, GROUPS, X_IN_ASM)
    for g0 in range(g_lo, g_hi, GROUPS):
        gate, gate_sc, up, up_sc, x = gate_next, gate_sc_next, up_next, up_sc_next, x_next
        gate_next, gate_sc_next = _load(gate_b, gate_s, n_ok, g0 + GROUPS, g_hi, GROUPS)
        up_next, up_sc_next = _load(up_b, up_s, n_ok, g0 + GROUPS, g_hi, GROUPS)
        x_next = _load_act(x_row, g0 + GROUPS, g_hi, GROUPS, X_IN_ASM)
        acc_gate = _acc(x_row, x, g0, g_hi, gate, gate_sc, acc_gate, GROUPS, ASM, X_IN_ASM)
        acc_up = _acc(x_row, x, g0, g_hi, up, up_sc, acc_up, GROUPS, ASM, X_IN_ASM)
    gate = tl.sum(acc_gate, 1)[None, :]
    up = tl.sum(acc_up, 1)[None, :]
    if SPLITS > 1:  # fp32 partials [split, pair, gate | up] (h_ptr): gate_up_finish does the rest
        row = h_ptr + (tl.program_id(2) * tl.num_programs(0) + pair).to(tl.int64) * stride_h
        tl.store(row + offs_n[None, :], gate, mask=n_ok[None, :])
        tl.store(row + I + offs_n[None, :], up, mask=n_ok[None, :])
        return
    if HAS_BIAS:
        bias_row = b_ptr + expert.to(tl.int64) * stride_bias
        gate += tl.load(bias_row + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(bias_row + I + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    act = activate_tile(gate, up, limit, alpha, ACT)
    h_row = h_ptr + pair.to(tl.int64) * stride_h
    tl.store(h_row + offs_n[None, :], act.to(h_ptr.dtype.element_ty), mask=n_ok[None, :])


@triton.jit
def _down_gemv(
    h_ptr, wb_ptr, ws_ptr, b_ptr, ids_ptr, weights_ptr, y_ptr, I, H, G_SPLIT,
    stride_h, stride_be, stride_bn, stride_se, stride_sn, stride_bias, stride_y,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, ASM: tl.constexpr,
    SPLITS: tl.constexpr, X_IN_ASM: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair)
    offs_n, n_ok, w_b, w_s = _rows(
        wb_ptr, ws_ptr, expert, H, stride_be, stride_bn, stride_se, stride_sn, BLOCK_N
    )
    h_row = h_ptr + pair.to(tl.int64) * stride_h
    acc = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    g_lo = tl.program_id(2) * G_SPLIT
    g_hi = tl.minimum(g_lo + G_SPLIT, I // 32)
    tile_next, scale_next = _load(w_b, w_s, n_ok, g_lo, g_hi, GROUPS)
    h_next = _load_act(h_row, g_lo, g_hi, GROUPS, X_IN_ASM)
    for g0 in range(g_lo, g_hi, GROUPS):
        tile, scale, h = tile_next, scale_next, h_next
        tile_next, scale_next = _load(w_b, w_s, n_ok, g0 + GROUPS, g_hi, GROUPS)
        h_next = _load_act(h_row, g0 + GROUPS, g_hi, GROUPS, X_IN_ASM)
        acc = _acc(h_row, h, g0, g_hi, tile, scale, acc, GROUPS, ASM, X_IN_ASM)
    out = tl.sum(acc, 1)
    if HAS_BIAS:  # once per pair, whatever the splits: by split 0
        bias = tl.load(b_ptr + expert.to(tl.int64) * stride_bias + offs_n, mask=n_ok, other=0.0)
        out += tl.where(tl.program_id(2) == 0, bias.to(tl.float32), 0.0)
    out *= tl.load(weights_ptr + pair)
    y_row = y_ptr + (pair * SPLITS + tl.program_id(2)).to(tl.int64) * stride_y
    tl.store(y_row + offs_n, out, mask=n_ok)


@triton.jit
def gate_up_finish(
    p_ptr, b_ptr, ids_ptr, h_ptr, num_pairs, I, limit, alpha, stride_bias, stride_h,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, COLS: tl.constexpr, SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Split-K's end for gate/up (this module's, mxfp4_moe's, mxfp4_mma's): sum the fp32 partials [splits,
    pairs, gate I | up I] of one pair's columns in split order (deterministic), add the expert's bias, apply
    the activation -> h, column n at n (COLS 0), [even columns | odd columns] (1), or in the tensor-core
    GEMV's pair order (2, mxfp4_order.pair_position)."""
    pair = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < I
    gate = tl.zeros((1, BLOCK), dtype=tl.float32)
    up = tl.zeros((1, BLOCK), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        row = p_ptr + (s * num_pairs + pair).to(tl.int64) * 2 * I
        gate += tl.load(row + offs, mask=ok, other=0.0)[None, :]
        up += tl.load(row + I + offs, mask=ok, other=0.0)[None, :]
    if HAS_BIAS:
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        gate += tl.load(b_ptr + expert * stride_bias + offs, mask=ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(b_ptr + expert * stride_bias + I + offs, mask=ok, other=0.0).to(tl.float32)[None, :]
    act = activate_tile(gate, up, limit, alpha, ACT)
    if COLS == 2:
        cols = pair_position(offs)
    else:  # in place, or [even | odd] as the fused kernels' split modes store it (MODES 0 and 1)
        cols = split_col(offs, I, COLS)
    tl.store(
        h_ptr + pair.to(tl.int64) * stride_h + cols[None, :], act.to(h_ptr.dtype.element_ty), mask=ok[None, :]
    )
