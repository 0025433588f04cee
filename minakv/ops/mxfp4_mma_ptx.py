"""The inline PTX of the one-token tensor-core GEMV's loop (mxfp4_mma.py), in two forms.

`mma_rows_ptx` (the default): a lane loads a step's words, scales and inputs into registers (4 groups, or
8) and waits for them before its MMAs. So a warp has one step (32 bytes a lane) in flight: with 45 groups a
warp (gpt-oss gate/up) that is 11-12 round trips to DRAM in a row, and the kernel read its 34 MB at ~37% of
the copy bandwidth where a plain read reaches 85% (bench/RESULTS.md, "Tensor-core GEMV").

`mma_rows_pipe_ptx`: each warp streams its 16 rows through a ring of STAGES slots of shared memory with
`cp.async` (16 bytes a copy, no registers held while in flight), so STAGES - 1 steps are on their way
while one is computed:

    prologue   the warp's scale bytes (rows g, all its groups: aligned 16-byte chunks around them) and
               steps 0 .. STAGES - 2, one commit group each
    step i     copy step i + STAGES - 1 into slot (i - 1) % STAGES, commit; wait until step i landed
               (`cp.async.wait_group STAGES - 1`), `bar.warp.sync`; read the A fragments and scales
               from slot i % STAGES, the inputs (B) from global memory (L1: every warp reads the same);
               decode, MMAs and scale FMAs as the register form; `bar.warp.sync` before the slot is reused

A slot holds U groups x 16 rows x 16 bytes, group-major, so lane (g, t) reads word t of rows g and g + 8
of a group from 32 consecutive words (no bank conflicts). A warp's scales take 16 rows x SCALE_ROW bytes:
the warp's groups must fit (`fits`). Both forms take the same operands and give the same results.
"""

from __future__ import annotations

SCALE_ROW = 128  # shared bytes per row for its scales: a warp's groups + 15 (the alignment) must fit
VARIANTS = {1: (4, 4), 2: (6, 4), 3: (4, 8)}  # PIPE -> (STAGES, groups a step), for the benches

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


def _step(unroll: int, tail: bool) -> str:
    """One unrolled step of `unroll` groups: loads, then decode and MMAs (tail: each group predicated)."""
    out = ""
    for j in range(unroll):
        p = f"q{j} " if tail else "qt "  # qt: always true
        if tail:
            out += f"add.s32 n{j}, n, {j}; setp.lt.s32 q{j}, n{j}, hi;\n"
        out += _LOAD.format(j=j, p=p, w=16 * j, s=j, x=64 * j)
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
    past the last read the last row."""
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
        + """mov.u32 tid, %tid.x; and.b32 lane, tid, 31; shr.u32 warp, tid, 5; shr.u32 g, lane, 2; and.b32 t, lane, 3;
mov.u32 ra, g; add.u32 rb, g, 8; sub.s32 la, $9, 1; min.s32 la, la, ra; sub.s32 lb, $9, 1; min.s32 lb, lb, rb;
setp.eq.u32 qt, g, g;
rem.u32 n, warp, $11; mul.lo.u32 n, n, $10; add.u32 n, n, $12; add.u32 hi, n, $10; min.s32 hi, hi, $8;
mul.wide.u32 o, la, $6; add.s64 wpa, $3, o; mul.wide.u32 o, lb, $6; add.s64 wpb, $3, o;
mul.wide.u32 o, n, 16; add.s64 wpa, wpa, o; add.s64 wpb, wpb, o;
mul.wide.u32 o, t, 4; add.s64 wpa, wpa, o; add.s64 wpb, wpb, o;
mul.wide.u32 o, la, $7; add.s64 spa, $4, o; mul.wide.u32 o, lb, $7; add.s64 spb, $4, o;
cvt.u64.u32 o, n; add.s64 spa, spa, o; add.s64 spb, spb, o;
mul.wide.u32 o, t, 16; add.s64 xp, $5, o; mul.wide.u32 o, n, 64; add.s64 xp, xp, o;
mov.b32 z, 0; mov.f32 e0, 0f00000000; mov.f32 e2, 0f00000000;
LOOP${:uid}:
"""
        + f"""add.s32 n0, n, {unroll}; setp.gt.s32 qe, n0, hi;
@qe bra.uni TAIL${{:uid}};
"""
        + _step(unroll, tail=False)
        + f"""add.s32 n, n, {unroll}; add.s64 wpa, wpa, {16 * unroll}; add.s64 wpb, wpb, {16 * unroll};
add.s64 spa, spa, {unroll}; add.s64 spb, spb, {unroll}; add.s64 xp, xp, {64 * unroll};
bra.uni LOOP${{:uid}};
TAIL${{:uid}}:
setp.lt.s32 qe, n, hi;
@!qe bra.uni DONE${{:uid}};
"""
        + _step(unroll, tail=True)
        + """DONE${:uid}:
mov.b32 $0, lane; mov.b32 $1, e0; mov.b32 $2, e2;
}"""
    )


def fits(groups_per_warp: int) -> bool:
    """Whether a warp's scale bytes (with up to 15 of alignment) fit its SCALE_ROW bytes a row."""
    return groups_per_warp + 15 <= SCALE_ROW


def _copy_step(unroll: int) -> str:
    """Copy the step at group `cg` into the slot at byte offset `ws`: lane l copies row l % 16 (clamped to
    the rows left), groups l / 16 + 2q of the step; groups at or past `hi` are not copied."""
    out = ""
    for q in range(unroll // 2):
        j = f"cj{q}"
        out += (
            f"add.s32 {j}, cg, {2 * q}; add.s32 {j}, {j}, half; setp.lt.s32 pc, {j}, hi;\n"
            f"add.u32 sd, wbase, ws; add.u32 sd, sd, {2 * q * 256}; add.u32 sd, sd, cdst;\n"
            f"@pc cp.async.cg.shared.global [sd], [csrc+{32 * q}], 16;\n"
        )
    return out + "cp.async.commit_group;\n"


def _advance_copy(stages: int, unroll: int) -> str:
    """The next step's copy: group, source and slot."""
    slot = 256 * unroll
    return (
        f"add.s32 cg, cg, {unroll}; add.s64 csrc, csrc, {16 * unroll};\n"
        f"add.u32 ws, ws, {slot}; setp.eq.u32 pc, ws, {stages * slot}; @pc mov.u32 ws, 0;\n"
    )


def _compute_step(unroll: int) -> str:
    """The step at group `k` from the slot at `rs`: fragments, scales and inputs, MMAs (each group
    predicated on k + j < hi), the scaled sums into e0 (row g) and e2 (row g + 8)."""
    out = ""
    for j in range(unroll):
        out += (
            f"add.s32 n0, k, {j}; setp.lt.s32 pj, n0, hi;\n"
            f"add.u32 sd, wbase, rs; add.u32 sd, sd, {j * 256}; add.u32 sd, sd, frag;\n"
            "ld.shared.b32 wa, [sd]; ld.shared.b32 wb, [sd+128];\n"
            f"add.u32 sd, sa_row, kk; ld.shared.u8 sa, [sd+{j}]; add.u32 sd, sb_row, kk; ld.shared.u8 sb, [sd+{j}];\n"
            f"@pj ld.global.nc.v4.b32 {{x0, x1, x2, x3}}, [xp+{64 * j}];\n"
        )
        out += DECODE.format(w="wa", p0="a0", p1="a2", p2="b0", p3="b2")
        out += DECODE.format(w="wb", p0="a1", p1="a3", p2="b1", p3="b3")
        out += _MMA.format(j="", p="pj ")  # (the register form's, on this group's registers)
    return out


def mma_rows_pipe_ptx(stages: int = 4, unroll: int = 4) -> str:
    """One lane's work (operands as mma_rows_ptx): the warp's groups [n, hi) of its 16 rows,
    `unroll` groups a step (even), `stages` slots."""
    slot = 256 * unroll  # bytes of a step: its groups x 16 rows x 16 bytes
    warp_bytes = stages * slot + 16 * SCALE_ROW
    scale_copies = "".join(
        f"add.s32 cj0, half, {2 * q}; setp.lt.s32 pc, cj0, nchunk; add.u32 sd, sdst, {32 * q};\n"
        f"@pc cp.async.cg.shared.global [sd], [ssrc+{32 * q}], 16;\n"
        for q in range(SCALE_ROW // 32)
    )
    prologue_copies = "".join(_copy_step(unroll) + _advance_copy(stages, unroll) for _ in range(stages - 1))
    return (
        """{
.shared .align 16 .b8 pipe_buf["""
        + str(4 * warp_bytes)
        + """];
.reg .pred pc, pj, qe;
.reg .b32 tid, lane, warp, g, t, cr, la, lb, n, hi, k, kk, half, cg, ws, rs, wbase, sd, cdst, frag, nchunk, sdst;
.reg .b32 sa_row, sb_row, cj0, cj1, cj2, cj3, n0, t0, t1, t2, wa, wb, sa, sb, x0, x1, x2, x3, z;
.reg .b32 a0, a1, a2, a3, b0, b1, b2, b3;
.reg .b16 h0, h1;
.reg .b64 csrc, ssrc, o, xp, sa_g, sb_g;
.reg .f32 c0, c1, c2, c3, e0, e2, fa, fb;
mov.u32 tid, %tid.x; and.b32 lane, tid, 31; shr.u32 warp, tid, 5; shr.u32 g, lane, 2; and.b32 t, lane, 3;
and.b32 cr, lane, 15; shr.u32 half, lane, 4;
rem.u32 n, warp, $11; mul.lo.u32 n, n, $10; add.u32 n, n, $12; add.u32 hi, n, $10; min.s32 hi, hi, $8;
mov.u32 wbase, pipe_buf; mul.lo.u32 t0, warp, """
        + str(warp_bytes)
        + """; add.u32 wbase, wbase, t0;
sub.s32 la, $9, 1; min.s32 la, la, cr;
mul.wide.u32 o, la, $6; add.s64 csrc, $3, o; mul.wide.s32 o, n, 16; add.s64 csrc, csrc, o;
mul.wide.u32 o, half, 16; add.s64 csrc, csrc, o;
shl.b32 cdst, half, 8; shl.b32 t0, cr, 4; add.u32 cdst, cdst, t0;
mul.wide.u32 o, la, $7; add.s64 ssrc, $4, o; cvt.s64.s32 o, n; add.s64 ssrc, ssrc, o;
cvt.u32.u64 t0, ssrc; and.b32 t1, t0, 15; sub.s32 t2, hi, n; add.s32 t2, t2, t1; add.s32 t2, t2, 15;
shr.s32 nchunk, t2, 4; and.b64 ssrc, ssrc, -16; mul.wide.u32 o, half, 16; add.s64 ssrc, ssrc, o;
add.u32 sdst, wbase, """
        + str(stages * slot)
        + """; mul.lo.u32 t0, cr, """
        + str(SCALE_ROW)
        + """; add.u32 sdst, sdst, t0; shl.b32 t0, half, 4; add.u32 sdst, sdst, t0;
"""
        + scale_copies
        + """sub.s32 la, $9, 1; min.s32 la, la, g; sub.s32 lb, $9, 1; add.u32 t0, g, 8; min.s32 lb, lb, t0;
mul.wide.u32 o, la, $7; add.s64 sa_g, $4, o; cvt.s64.s32 o, n; add.s64 sa_g, sa_g, o;
mul.wide.u32 o, lb, $7; add.s64 sb_g, $4, o; cvt.s64.s32 o, n; add.s64 sb_g, sb_g, o;
add.u32 sa_row, wbase, """
        + str(stages * slot)
        + """; mul.lo.u32 t0, g, """
        + str(SCALE_ROW)
        + """; add.u32 sa_row, sa_row, t0; cvt.u32.u64 t0, sa_g; and.b32 t0, t0, 15; add.u32 sa_row, sa_row, t0;
add.u32 sb_row, wbase, """
        + str(stages * slot)
        + """; add.u32 t0, g, 8; mul.lo.u32 t0, t0, """
        + str(SCALE_ROW)
        + """; add.u32 sb_row, sb_row, t0; cvt.u32.u64 t0, sb_g; and.b32 t0, t0, 15; add.u32 sb_row, sb_row, t0;
shl.b32 frag, g, 4; shl.b32 t0, t, 2; add.u32 frag, frag, t0;
mul.wide.u32 o, t, 16; add.s64 xp, $5, o; mul.wide.s32 o, n, 64; add.s64 xp, xp, o;
mov.b32 z, 0; mov.f32 e0, 0f00000000; mov.f32 e2, 0f00000000;
mov.u32 cg, n; mov.u32 ws, 0; mov.u32 rs, 0; mov.u32 k, n; mov.u32 kk, 0;
"""
        + prologue_copies
        + """LOOP${:uid}:
setp.ge.s32 qe, k, hi;
@qe bra.uni DONE${:uid};
"""
        + _copy_step(unroll)
        + _advance_copy(stages, unroll)
        + f"cp.async.wait_group {stages - 1};\nbar.warp.sync 0xffffffff;\n"
        + _compute_step(unroll)
        + f"""bar.warp.sync 0xffffffff;
add.s32 k, k, {unroll}; add.u32 kk, kk, {unroll}; add.s64 xp, xp, {64 * unroll};
add.u32 rs, rs, {slot}; setp.eq.u32 pc, rs, {stages * slot}; @pc mov.u32 rs, 0;
bra.uni LOOP${{:uid}};
DONE${{:uid}}:
cp.async.wait_all;
mov.b32 $0, lane; mov.b32 $1, e0; mov.b32 $2, e2;
}}"""
    )
