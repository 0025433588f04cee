"""The inline PTX of the one-token tensor-core GEMV's loop (mxfp4_mma.py).

`mma_rows_ptx`: a lane loads a step's words, scales and inputs into registers (4 groups, or 8), then
decodes and runs its MMAs. The weights are in tiles (mxfp4_layout.py), so a warp's load of a group is one
256-byte run instead of 16 bytes of 16 rows 1,440 bytes apart: on the H100 that took gpt-oss-120b's batch-1
step from 2.834 to 2.691 ms, where more loads in flight a warp (a `cp.async` ring in shared memory; 8 groups
a step with the inputs loaded late) and fewer L1 wavefronts had changed nothing (bench/RESULTS.md).
"""

from __future__ import annotations

# Two fp16 pairs per E2M1 byte pair: a word's 8 codes -> the A fragment registers (see mxfp4_mma.py).
DECODE = """shl.b32 t0, {w}, 2; shl.b32 t1, {w}, 4; and.b32 t1, t1, 0x80808080;
lop3.b32 t2, t0, 0x1C1C1C1C, t1, 0xEA; mov.b32 {{h0, h1}}, t2;
cvt.rn.f16x2.e4m3x2 {p0}, h0; cvt.rn.f16x2.e4m3x2 {p1}, h1;
shr.b32 t0, {w}, 2; and.b32 t1, {w}, 0x80808080;
lop3.b32 t2, t0, 0x1C1C1C1C, t1, 0xEA; mov.b32 {{h0, h1}}, t2;
cvt.rn.f16x2.e4m3x2 {p2}, h0; cvt.rn.f16x2.e4m3x2 {p3}, h1;
"""


# `unroll`, groups a lane loads before it uses any (10 bytes of weights and scales each): 4 (63 registers,
# 8 programs a SM) or 8 (96-102 registers, 5 a SM; slower on the H200, RESULTS.md)

# group j of an unrolled step. The fast step (all UNROLL groups below the warp's end) loads without
# predicates, so ptxas can issue every load before the first use; the tail step predicates on q{j}.
_LOAD = """@{p}ld.global.nc.b32 wa{j}, [wpa+{w}]; @{p}ld.global.nc.u8 sa{j}, [spa+{s}];
@{p}ld.global.nc.b32 wb{j}, [wpb+{w}]; @{p}ld.global.nc.u8 sb{j}, [spb+{s}];
@{p}ld.global.nc.v4.b32 {{x0{j}, x1{j}, x2{j}, x3{j}}}, [xp+{x}];
"""
_MMA = """@{p}mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{c0, c1, c2, c3}}, {{a0, a1, a2, a3}}, {{x0{j}, x1{j}}}, {{z, z, z, z}};
@{p}mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{c0, c1, c2, c3}}, {{b0, b1, b2, b3}}, {{x2{j}, x3{j}}}, {{c0, c1, c2, c3}};
add.u32 sa{j}, sa{j}, 6; shl.b32 sa{j}, sa{j}, 23; mov.b32 fa, sa{j}; add.u32 sb{j}, sb{j}, 6; shl.b32 sb{j}, sb{j}, 23;
mov.b32 fb, sb{j}; @{p}fma.rn.f32 e0, c0, fa, e0; @{p}fma.rn.f32 e2, c2, fb, e2;
"""


def _step(unroll: int, tail: bool, gb: int, sgb: int) -> str:
    """One unrolled step of `unroll` groups: loads, then decode and MMAs (tail: each group predicated).
    gb / sgb: bytes from one group of a row to the next, in the blocks / the scales."""
    out = ""
    for j in range(unroll):
        p = f"q{j} " if tail else "qt "  # qt: always true
        if tail:
            out += f"add.s32 n{j}, n, {j}; setp.lt.s32 q{j}, n{j}, hi;\n"
        out += _LOAD.format(j=j, p=p, w=gb * j, s=sgb * j, x=64 * j)
    for j in range(unroll):
        p = f"q{j} " if tail else "qt "
        out += DECODE.format(w=f"wa{j}", p0="a0", p1="a2", p2="b0", p3="b2")
        out += DECODE.format(w=f"wb{j}", p0="a1", p1="a3", p2="b1", p3="b3")
        out += _MMA.format(j=j, p=p)
    return out


def mma_rows_ptx(unroll: int) -> str:
    """The PTX of one lane's work, `unroll` groups a step. Operands: $0 the lane, $1 / $2 its warp's partial
    sums over the warp's share of the groups for rows g and g + 8 (g = lane / 4) of C column 2t (t = lane %
    4: the pair's column 0 is t = 0's); $3 first row's bytes, $4 its scales, $5 this lane's column's fp16
    inputs (pair order), $6 / $7 bytes per row of blocks / scales, $12 / $8 first and end group, $9 rows
    left from the first, $10 groups per warp, $11 warps per row set (warp w takes share w % $11). Rows
    past the last read the last row. The weights are in tiles (mxfp4_layout.py): $6 = 16, $7 = 1, and a
    group of the tile's 16 rows is `gb` bytes on from the one before (its scales `sgb`)."""
    gb, sgb = 256, 16
    first_scale = f"mul.wide.u32 o, n, {sgb}"  # o = n * sgb
    regs = "".join(
        f".reg .pred q{j};\n.reg .b32 n{j}, wa{j}, wb{j}, sa{j}, sb{j}, x0{j}, x1{j}, x2{j}, x3{j};\n"
        for j in range(unroll)
    )
    return (
        """{
.reg .pred qt, qe;
.reg .b32 tid, lane, warp, g, t, ra, rb, la, lb, n, hi, t0, t1, t2, a0, a1, a2, a3, b0, b1, b2, b3, z;
.reg .b16 h0, h1;
.reg .b64 wpa, wpb, spa, spb, xp, o;
.reg .f32 c0, c1, c2, c3, e0, e2, fa, fb;
"""
        + regs
        + f"""mov.u32 tid, %tid.x; and.b32 lane, tid, 31; shr.u32 warp, tid, 5; shr.u32 g, lane, 2; and.b32 t, lane, 3;
mov.u32 ra, g; add.u32 rb, g, 8; sub.s32 la, $9, 1; min.s32 la, la, ra; sub.s32 lb, $9, 1; min.s32 lb, lb, rb;
setp.eq.u32 qt, g, g;
rem.u32 n, warp, $11; mul.lo.u32 n, n, $10; add.u32 n, n, $12; add.u32 hi, n, $10; min.s32 hi, hi, $8;
mul.wide.u32 o, la, $6; add.s64 wpa, $3, o; mul.wide.u32 o, lb, $6; add.s64 wpb, $3, o;
mul.wide.u32 o, n, {gb}; add.s64 wpa, wpa, o; add.s64 wpb, wpb, o;
mul.wide.u32 o, t, 4; add.s64 wpa, wpa, o; add.s64 wpb, wpb, o;
mul.wide.u32 o, la, $7; add.s64 spa, $4, o; mul.wide.u32 o, lb, $7; add.s64 spb, $4, o;
{first_scale}; add.s64 spa, spa, o; add.s64 spb, spb, o;
mul.wide.u32 o, t, 16; add.s64 xp, $5, o; mul.wide.u32 o, n, 64; add.s64 xp, xp, o;
mov.b32 z, 0; mov.f32 e0, 0f00000000; mov.f32 e2, 0f00000000;
LOOP${{:uid}}:
"""
        + f"""add.s32 n0, n, {unroll}; setp.gt.s32 qe, n0, hi;
@qe bra.uni TAIL${{:uid}};
"""
        + _step(unroll, tail=False, gb=gb, sgb=sgb)
        + f"""add.s32 n, n, {unroll}; add.s64 wpa, wpa, {gb * unroll}; add.s64 wpb, wpb, {gb * unroll};
add.s64 spa, spa, {sgb * unroll}; add.s64 spb, spb, {sgb * unroll}; add.s64 xp, xp, {64 * unroll};
bra.uni LOOP${{:uid}};
TAIL${{:uid}}:
setp.lt.s32 qe, n, hi;
@!qe bra.uni DONE${{:uid}};
"""
        + _step(unroll, tail=True, gb=gb, sgb=sgb)
        + """DONE${:uid}:
mov.b32 $0, lane; mov.b32 $1, e0; mov.b32 $2, e2;
}"""
    )
