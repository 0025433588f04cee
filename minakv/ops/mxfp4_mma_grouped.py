"""MXFP4 MoE on the tensor cores for many pairs per expert: a small grouped GEMM in inline PTX.

The per-pair GEMV (mxfp4_mma.py) reads an expert once per pair that chose it, so it pays only while the
pairs are no more than the experts. Beyond, the pairs are grouped by expert on the device
(moe_groups.group_by_expert, tiles of 8 * NT pairs of one expert), the activations gathered in that order
(`pair_order(x, order)`), and a warp computes MR x NT MMA tiles: MR tiles of 16 weight rows (decoded once a
group, as in mxfp4_mma.py) times NT tiles of 8 pairs (the B fragments, loaded once a group):

    warp w of program (tile, rows)        MR = 4 for gate/up: gate rows n..n+16, up rows n..n+16,
                                                              gate rows n+16..n+32, up rows n+16..n+32
      for each group of 32 inputs:        (a warp holds gate and up of the same columns: it activates
        load MR x 2 words + scales         them in registers and writes h; down: MR tiles of output rows)
        load NT x 8 fp16 (its pairs' B)
        decode each row tile once, 2 MMAs against each pair tile -> x scale -> MR x NT accumulators

Why this shape: a B fragment from L1 (256 bytes a warp) serves MR row tiles, a decoded A fragment NT pair
tiles, so neither the L1 traffic of the activations nor the decode instructions grow with the batch.
Each warp runs all groups of its rows (no split-K, no cross-warp sums): the shape of the loop (groups,
row strides, the offsets of the row tiles) is fixed by the weights, so the PTX is generated per shape with
every address an immediate off three base pointers, and without predicates. A warp whose rows would pass
the end is moved back to end at the last row (its duplicated rows are not stored). Gate/up writes h in
the sorted order, so down reads its pairs' rows as contiguous tiles; down writes each pair's fp32 row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minakv.ops.moe_groups import ACTIVATIONS, group_by_expert, k_parts, tile_start
from minakv.ops.mxfp4_mma import WARPS, activate_store
from minakv.ops.mxfp4_mma_ptx import DECODE
from minakv.ops.mxfp4_order import pair_order

FRAGMENT = ("a0", "a1", "a2", "a3", "b0", "b1", "b2", "b3")  # A fragments: rows g, g + 8, g, g + 8 each
FOLD_RANGE = (107, 136)  # scale bytes whose 2^(s - 121) is a normal fp16 and FP4 x 2^(s - 127) exact in fp16


def fold_fits(w: dict[str, torch.Tensor]) -> bool:
    """Whether every scale byte of the layer is in FOLD_RANGE (one host sync: decide once per layer)."""
    lo, hi = FOLD_RANGE
    return all(bool(((w[k] >= lo) & (w[k] <= hi)).all()) for k in ("gate_up_scales", "down_scales"))


def tiles_asm(mr: int, nt: int, unroll: int, groups: int, row_offs: list[int], stride_bn: int,
              stride_sn: int, warp_rows: int, last_row: int, x_row: int, fold: bool = False) -> str:  # fmt: skip
    """One warp's MR x NT tiles over `groups` groups, `unroll` groups a step. Operands: $0 the thread's
    %tid.x, then the 4 * MR * NT sums (tile (i, c)'s C fragment at 1 + 4 (i NT + c): rows g, g + 8 of row
    tile i (g = lane / 4) times columns 2t, 2t + 1 of pair tile c (t = lane % 4)); inputs: the program's
    first weight row (bytes), its scales, its first pair's fp16 row, the program's first row. row_offs:
    each row tile's first row from the warp's (rows); warp w starts at min(first + w * warp_rows,
    last_row); x_row: bytes per activation row. fold: scale the decoded fp16 weights by 2^(s - 121) with
    `mul.rn.f16x2` (exact for scale bytes in FOLD_RANGE, `fold_fits`) and accumulate in the MMAs' own C,
    instead of 4 fp32 FMAs per MMA pair (2 a row tile per pair tile per group). The weights are in tiles
    (mxfp4_layout.py), so rows, warp_rows and row_offs are multiples of 16."""
    # bytes from a row to the next, from a group to the next, inside a tile: blocks, scales (the warp's
    # first row r is its tile's, and row g of the tile is 16 g bytes on, its scales g)
    rb, gb, rs, gs = 16, 256, 1, 16
    in_tile = "mul.wide.u32 o, g, 16; add.s64 wp, wp, o; cvt.u64.u32 o, g; add.s64 sp, sp, o;\n"
    n_out = 1 + 4 * mr * nt
    wb, sb, xb, r0 = (f"${n_out + j}" for j in range(4))
    regs = [f"w{i}a{j}, w{i}b{j}, s{i}a{j}, s{i}b{j}" for i in range(mr) for j in range(unroll)]
    regs += [f"x{c}q{q}u{j}" for c in range(nt) for q in range(4) for j in range(unroll)]
    acc = [f"e{i}c{c}k{k}" for i in range(mr) for c in range(nt) for k in range(4)]

    def step(count: int) -> str:
        out = ""
        for j in range(count):
            for i in range(mr):
                w, s = row_offs[i] * stride_bn + gb * j, row_offs[i] * stride_sn + gs * j
                out += (f"ld.global.nc.b32 w{i}a{j}, [wp+{w}]; ld.global.nc.b32 w{i}b{j}, [wp+{w + 8 * rb}];\n"
                        f"ld.global.nc.u8 s{i}a{j}, [sp+{s}]; ld.global.nc.u8 s{i}b{j}, [sp+{s + 8 * rs}];\n")  # fmt: skip
            for c in range(nt):
                xq = ", ".join(f"x{c}q{q}u{j}" for q in range(4))
                out += f"ld.global.nc.v4.b32 {{{xq}}}, [xp+{c * 8 * x_row + 64 * j}];\n"
        for j in range(count):
            for i in range(mr):
                out += DECODE.format(w=f"w{i}a{j}", p0="a0", p1="a2", p2="b0", p3="b2")
                out += DECODE.format(w=f"w{i}b{j}", p0="a1", p1="a3", p2="b1", p3="b3")
                if fold:  # 2^(s - 121) as fp16 in both halves: biased exponent s - 106 at bits 10 and 26
                    out += (f"sub.u32 t0, s{i}a{j}, 106; mul.lo.u32 ha, t0, 0x04000400;\n"
                            f"sub.u32 t0, s{i}b{j}, 106; mul.lo.u32 hb, t0, 0x04000400;\n")  # fmt: skip
                    out += "".join(
                        f"mul.rn.f16x2 {r}, {r}, {h};\n" for r, h in zip(FRAGMENT, ("ha", "hb") * 4)
                    )
                    for c in range(nt):
                        e = ", ".join(f"e{i}c{c}k{k}" for k in range(4))
                        out += (
                            f"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{{e}}}, {{a0, a1, a2, a3}}, "
                            f"{{x{c}q0u{j}, x{c}q1u{j}}}, {{{e}}};\n"
                            f"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{{e}}}, {{b0, b1, b2, b3}}, "
                            f"{{x{c}q2u{j}, x{c}q3u{j}}}, {{{e}}};\n"
                        )
                    continue
                out += (f"add.u32 t0, s{i}a{j}, 6; shl.b32 t0, t0, 23; mov.b32 fa, t0;\n"
                        f"add.u32 t0, s{i}b{j}, 6; shl.b32 t0, t0, 23; mov.b32 fb, t0;\n")  # fmt: skip
                for c in range(nt):
                    e = [f"e{i}c{c}k{k}" for k in range(4)]
                    out += (
                        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {c0, c1, c2, c3}, {a0, a1, a2, a3}, "
                        f"{{x{c}q0u{j}, x{c}q1u{j}}}, {{z, z, z, z}};\n"
                        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {c0, c1, c2, c3}, {b0, b1, b2, b3}, "
                        f"{{x{c}q2u{j}, x{c}q3u{j}}}, {{c0, c1, c2, c3}};\n"
                        f"fma.rn.f32 {e[0]}, c0, fa, {e[0]}; fma.rn.f32 {e[1]}, c1, fa, {e[1]};\n"
                        f"fma.rn.f32 {e[2]}, c2, fb, {e[2]}; fma.rn.f32 {e[3]}, c3, fb, {e[3]};\n"
                    )
        return out

    steps, tail = divmod(groups, unroll)
    loop = (
        f"mov.u32 n, {steps};\nLOOP${{:uid}}:\n" + step(unroll)
        + f"add.s64 wp, wp, {gb * unroll}; add.s64 sp, sp, {gs * unroll}; add.s64 xp, xp, {64 * unroll};\n"
        + "sub.s32 n, n, 1; setp.ne.s32 p, n, 0; @p bra.uni LOOP${:uid};\n"
        if steps else ""
    )  # fmt: skip
    return (
        "{\n.reg .pred p;\n.reg .b32 tid, lane, warp, g, t, n, r, t0, t1, t2, a0, a1, a2, a3, b0, b1, b2, b3, z;\n"
        ".reg .b16 h0, h1;\n.reg .b64 wp, sp, xp, o;\n.reg .f32 c0, c1, c2, c3, fa, fb;\n.reg .b32 ha, hb;\n"
        + "".join(f".reg .b32 {r};\n" for r in regs)
        + "".join(f".reg .f32 {a};\n" for a in acc)
        + f"""mov.u32 tid, %tid.x; and.b32 lane, tid, 31; shr.u32 warp, tid, 5; shr.u32 g, lane, 2; and.b32 t, lane, 3;
mul.lo.u32 r, warp, {warp_rows}; add.u32 r, r, {r0}; min.s32 r, r, {last_row};
mul.wide.u32 o, r, {stride_bn}; add.s64 wp, {wb}, o; mul.wide.u32 o, t, 4; add.s64 wp, wp, o;
mul.wide.u32 o, r, {stride_sn}; add.s64 sp, {sb}, o;
{in_tile}mul.wide.u32 o, g, {x_row}; add.s64 xp, {xb}, o; mul.wide.u32 o, t, 16; add.s64 xp, xp, o;
mov.b32 z, 0;
"""
        + "".join(f"mov.f32 {a}, 0f00000000;\n" for a in acc)
        + loop
        + step(tail)
        + "mov.b32 $0, tid;\n"
        + "".join(f"mov.b32 ${1 + k}, {a};\n" for k, a in enumerate(acc))
        + "}"
    )


@triton.jit
def _tiles(w_ptr, s_ptr, x_ptr, row0, ASM: tl.constexpr, N_SUMS: tl.constexpr):
    """Run `tiles_asm` on this program's 32 * WARPS threads -> (tid, its N_SUMS sums), one element a thread."""
    zero = tl.arange(0, 32 * WARPS) * 0
    return tl.inline_asm_elementwise(
        ASM, "=r" + ",=r" * N_SUMS + ",l,l,l,r",
        [(w_ptr + zero).to(tl.int64), (s_ptr + zero).to(tl.int64), (x_ptr + zero).to(tl.int64), zero + row0],
        dtype=(tl.int32,) + (tl.float32,) * N_SUMS, is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _place(tid, prog_row0, i, c, k, warp_rows, N, left):
    """Where sum k of tile (i, c) of a thread goes: (output row, is it this warp's to store, pair column
    of the tile, is that column one of the expert's pairs); rows as `tiles_asm` moves the warp."""
    lane = tid % 32
    first = prog_row0 + (tid // 32) * warp_rows  # the warp's rows before the move back
    start = tl.minimum(first, N - warp_rows)
    row = start + i * 16 + lane // 4 + 8 * (k // 2)
    col = c * 8 + 2 * (lane % 4) + k % 2
    return row, (row >= first) & (row < N), col, col < left


@triton.jit
def _gate_up_tiles(
    x_ptr, wb_ptr, ws_ptr, b_ptr, counts_ptr, starts_ptr, tile_ends_ptr, h_ptr, num_experts, I, limit, alpha,
    stride_be, stride_se, stride_bias, stride_x, stride_h, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    ASM: tl.constexpr, MR: tl.constexpr, NT: tl.constexpr, E_PAD: tl.constexpr,
):  # fmt: skip
    expert, r0, left = tile_start(tl.program_id(0), counts_ptr, starts_ptr, tile_ends_ptr, num_experts, E_PAD,
                                  8 * NT)  # fmt: skip
    if expert >= num_experts:
        return
    warp_rows: tl.constexpr = 8 * MR  # output columns a warp: MR / 2 gate tiles and as many up tiles
    row0 = tl.program_id(1) * WARPS * warp_rows
    out = _tiles(wb_ptr + expert.to(tl.int64) * stride_be, ws_ptr + expert.to(tl.int64) * stride_se,
                 x_ptr + r0.to(tl.int64) * stride_x, row0, ASM, 4 * MR * NT)  # fmt: skip
    for i in tl.static_range(MR // 2):
        for c in tl.static_range(NT):
            for k in tl.static_range(4):
                n, mine, col, real = _place(out[0], row0, i, c, k, warp_rows, I, left)
                gate = out[1 + 4 * (2 * i * NT + c) + k]  # row tile 2i: gate rows; 2i + 1: the same up rows
                up = out[1 + 4 * ((2 * i + 1) * NT + c) + k]
                h_row = h_ptr + (r0 + col).to(tl.int64) * stride_h
                activate_store(gate, up, n, mine & real, b_ptr, expert, stride_bias, I, limit, alpha, h_row,
                               HAS_BIAS, ACT)  # fmt: skip


@triton.jit
def _down_tiles(
    h_ptr, wb_ptr, ws_ptr, b_ptr, order_ptr, counts_ptr, starts_ptr, tile_ends_ptr, weights_ptr, y_ptr,
    num_experts, H, stride_be, stride_se, stride_bias, stride_h, stride_y, HAS_BIAS: tl.constexpr,
    ASM: tl.constexpr, MR: tl.constexpr, NT: tl.constexpr, E_PAD: tl.constexpr,
):  # fmt: skip
    expert, r0, left = tile_start(tl.program_id(0), counts_ptr, starts_ptr, tile_ends_ptr, num_experts, E_PAD,
                                  8 * NT)  # fmt: skip
    if expert >= num_experts:
        return
    e = expert.to(tl.int64)
    warp_rows: tl.constexpr = 16 * MR
    row0 = tl.program_id(1) * WARPS * warp_rows
    out = _tiles(wb_ptr + e * stride_be, ws_ptr + e * stride_se, h_ptr + r0.to(tl.int64) * stride_h, row0,
                 ASM, 4 * MR * NT)  # fmt: skip
    for i in tl.static_range(MR):
        for c in tl.static_range(NT):
            for k in tl.static_range(4):
                n, mine, col, real = _place(out[0], row0, i, c, k, warp_rows, H, left)
                ok = mine & real
                y = out[1 + 4 * (i * NT + c) + k]
                if HAS_BIAS:
                    y += tl.load(b_ptr + e * stride_bias + n, mask=ok, other=0.0).to(tl.float32)
                pair = tl.load(order_ptr + r0 + col, mask=real, other=0)
                weight = tl.load(weights_ptr + pair, mask=real, other=0.0)
                tl.store(y_ptr + pair.to(tl.int64) * stride_y + n, y * weight, mask=ok)


def row_tiles(rows: int, gate_up: bool, mr: int) -> int:
    """Row tiles a warp (MR), at most `mr`, so that a warp's rows fit in the weight's `rows` (2I or H)."""
    while mr > (2 if gate_up else 1) and (8 if gate_up else 16) * mr > rows // (2 if gate_up else 1):
        mr //= 2
    return mr


def moe_mxfp4_mma_grouped(x, w, topk_weights, topk_ids, gate_up_bias=None, down_bias=None, activation="silu",
                          limit=7.0, alpha=1.702, *, sum_k: bool = True, nt: int = 4, mr: int = 4,
                          unroll: int = 2, fold: bool = False) -> torch.Tensor:  # fmt: skip
    """`moe_mxfp4_gemv`'s result (its first arguments), each expert read once per 8 * nt of its pairs (CUDA
    only). nt: pair tiles of 8 a warp; mr: row tiles of 16 a warp (gate/up: half gate, half up; fewer when
    the weights have fewer rows); unroll: groups a lane loads before it uses any; fold: the scales folded
    into the fp16 weights (`tiles_asm`; only where `fold_fits(w)`). w in tiles (mxfp4_layout.py)."""
    num_tokens, k = topk_ids.shape
    num_pairs = num_tokens * k
    hidden = x.shape[1]
    gub, gus, db, ds = (w[key] for key in ("gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales"))
    num_experts, inter = gub.shape[0], gub.shape[1] // 2
    cols = 8 * nt
    order, counts, starts, tile_ends, max_tiles = group_by_expert(topk_ids, num_experts, cols)
    plan = (counts, starts, tile_ends)
    e_pad = triton.next_power_of_2(num_experts)
    dummy = counts
    xs = pair_order(x, order, k, pad=cols)  # [pairs + cols, H]: the pad rows are zeros
    h = torch.empty(num_pairs + cols, inter, dtype=torch.float16, device=x.device)  # pad rows: never stored
    mr_gu = row_tiles(2 * inter, True, mr)
    asm = tiles_asm(mr_gu, nt, unroll, hidden // 32, [8 * i if i % 2 == 0 else inter + 8 * (i - 1) for i in
                    range(mr_gu)], gub.stride(1), gus.stride(1), 8 * mr_gu, inter - 8 * mr_gu, 2 * hidden, fold)  # fmt: skip
    _gate_up_tiles[(max_tiles, triton.cdiv(inter, WARPS.value * 8 * mr_gu))](
        xs, gub, gus, gate_up_bias if gate_up_bias is not None else dummy, *plan, h, num_experts, inter,
        float(limit), float(alpha), gub.stride(0), gus.stride(0),
        gate_up_bias.stride(0) if gate_up_bias is not None else 0, xs.stride(0), h.stride(0),
        HAS_BIAS=gate_up_bias is not None, ACT=ACTIVATIONS[activation], ASM=asm, MR=mr_gu, NT=nt, E_PAD=e_pad,
        num_warps=WARPS.value,
    )  # fmt: skip
    mr_d = row_tiles(hidden, False, mr)
    asm = tiles_asm(mr_d, nt, unroll, inter // 32, [16 * i for i in range(mr_d)], db.stride(1), ds.stride(1),
                    16 * mr_d, hidden - 16 * mr_d, 2 * inter, fold)  # fmt: skip
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _down_tiles[(max_tiles, triton.cdiv(hidden, WARPS.value * 16 * mr_d))](
        h, db, ds, down_bias if down_bias is not None else dummy, order, *plan, weights, y, num_experts, hidden,
        db.stride(0), ds.stride(0), down_bias.stride(0) if down_bias is not None else 0, h.stride(0), y.stride(0),
        HAS_BIAS=down_bias is not None, ASM=asm, MR=mr_d, NT=nt, E_PAD=e_pad, num_warps=WARPS.value,
    )  # fmt: skip
    return k_parts(y, num_tokens, k, x.dtype, sum_k)
