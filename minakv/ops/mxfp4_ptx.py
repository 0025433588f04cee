"""MXFP4 dot products in inline PTX: a packed 32-bit word's 8 E2M1 codes times their 8 inputs, for the
GEMV of mxfp4_gemv.py (GPU only: Triton's interpreter has no inline assembly, so the GEMV runs `dot8`'s
arithmetic fallback there, and the GPU tests check the assembly against fp32).

A byte holds two codes, the low nibble the even input, so a word holds inputs 0..7 in bits 4m..4m+3. The
code's bits e1 e0 m0 put right under fp16's exponent, and its sign on fp16's, make an fp16 equal to the FP4
value times 2^-14 (the 0.5 code lands on an fp16 subnormal, exact); the caller puts the 2^14 into the
group's scale. Two `prmt` spread bytes (0, 1) and (2, 3) over the halves of a register; a shift and two
masks per nibble position then make two fp16 at once:

    word  b3 b2 b1 b0  --prmt-->  [0 b1 0 b0], [0 b3 0 b2]  --shift, mask-->  fp16 pairs (0, 2) (4, 6) (1, 3) (5, 7)
          --cvt--> 8 fp32 --fma with the 8 inputs--> one fp32 partial sum
"""

from __future__ import annotations

import triton
import triton.language as tl

from minakv.ops.mxfp4_tile import e2m1_f16

# One 32-bit word of packed bytes ($1: 8 codes, the code of input m in bits 4m..4m+3) and its 8 inputs -> the
# sum of code value * 2^-14 * input ($0, fp32). prmt spreads bytes (0, 1) and (2, 3) over the halves of a
# register; a shift and two masks per nibble position then make two fp16 at once: inputs (0, 2), (4, 6),
# (1, 3), (5, 7). The inputs come as 8 fp32 registers ($2..$9, DOT8_PTX), or the block loads them itself
# from the address of 8 consecutive bf16 ($2, DOT8_LOAD_PTX): then no thread needs another's activations,
# so they are never exchanged through shared memory.
_REGS = """.reg .b32 t01, t23, a, b, r0, r1, r2, r3, q0, q1, q2, q3;
.reg .b16 h0, h1, h2, h3, h4, h5, h6, h7;
.reg .f32 f0, f1, f2, f3, f4, f5, f6, f7, s, x0, x1, x2, x3, x4, x5, x6, x7;
"""
_DECODE = """prmt.b32 t01, $1, 0, 0x4140;
prmt.b32 t23, $1, 0, 0x4342;
shl.b32 a, t01, 9; and.b32 a, a, 0x0E000E00; shl.b32 b, t01, 12; and.b32 b, b, 0x80008000; or.b32 r0, a, b;
shl.b32 a, t23, 9; and.b32 a, a, 0x0E000E00; shl.b32 b, t23, 12; and.b32 b, b, 0x80008000; or.b32 r1, a, b;
shl.b32 a, t01, 5; and.b32 a, a, 0x0E000E00; shl.b32 b, t01, 8;  and.b32 b, b, 0x80008000; or.b32 r2, a, b;
shl.b32 a, t23, 5; and.b32 a, a, 0x0E000E00; shl.b32 b, t23, 8;  and.b32 b, b, 0x80008000; or.b32 r3, a, b;
mov.b32 {h0, h2}, r0;
mov.b32 {h4, h6}, r1;
mov.b32 {h1, h3}, r2;
mov.b32 {h5, h7}, r3;
cvt.f32.f16 f0, h0; cvt.f32.f16 f1, h1; cvt.f32.f16 f2, h2; cvt.f32.f16 f3, h3;
cvt.f32.f16 f4, h4; cvt.f32.f16 f5, h5; cvt.f32.f16 f6, h6; cvt.f32.f16 f7, h7;
"""
_FMAS = """mul.f32 s, f0, {};
fma.rn.f32 s, f1, {}, s; fma.rn.f32 s, f2, {}, s; fma.rn.f32 s, f3, {}, s; fma.rn.f32 s, f4, {}, s;
fma.rn.f32 s, f5, {}, s; fma.rn.f32 s, f6, {}, s; fma.rn.f32 s, f7, {}, s;
mov.b32 $0, s;
"""
_LOAD_BF16X8 = """ld.global.nc.v4.b32 {q0, q1, q2, q3}, [$2];
shl.b32 x0, q0, 16; and.b32 x1, q0, 0xFFFF0000; shl.b32 x2, q1, 16; and.b32 x3, q1, 0xFFFF0000;
shl.b32 x4, q2, 16; and.b32 x5, q2, 0xFFFF0000; shl.b32 x6, q3, 16; and.b32 x7, q3, 0xFFFF0000;
"""
DOT8_PTX = tl.constexpr("{\n" + _REGS + _DECODE + _FMAS.format(*(f"${i}" for i in range(2, 10))) + "}")
DOT8_LOAD_PTX = tl.constexpr(
    "{\n" + _REGS + _LOAD_BF16X8 + _DECODE + _FMAS.format(*(f"x{i}" for i in range(8))) + "}"
)


@triton.jit
def dot8(words, x0, x1, x2, x3, x4, x5, x6, x7, ASM: tl.constexpr):
    """Per packed word: the sum over its 8 inputs of FP4 value * 2^-14 * input (fp32)."""
    if ASM:
        out = tl.inline_asm_elementwise(
            DOT8_PTX, "=r,r,r,r,r,r,r,r,r,r", [words, x0, x1, x2, x3, x4, x5, x6, x7], dtype=tl.float32,
            is_pure=True, pack=1,
        )  # fmt: skip
    else:  # the same arithmetic per code (mxfp4_tile.e2m1_f16)
        out = e2m1_f16(words & 0xF).to(tl.float32) * x0
        out += e2m1_f16((words >> 4) & 0xF).to(tl.float32) * x1
        out += e2m1_f16((words >> 8) & 0xF).to(tl.float32) * x2
        out += e2m1_f16((words >> 12) & 0xF).to(tl.float32) * x3
        out += e2m1_f16((words >> 16) & 0xF).to(tl.float32) * x4
        out += e2m1_f16((words >> 20) & 0xF).to(tl.float32) * x5
        out += e2m1_f16((words >> 24) & 0xF).to(tl.float32) * x6
        out += e2m1_f16((words >> 28) & 0xF).to(tl.float32) * x7
    return out


@triton.jit
def dot8_load(words, addr):
    """Per packed word: the same sum, its 8 bf16 inputs loaded by the PTX block from `addr` (int64, 16-byte
    aligned): no thread needs another's activations."""
    return tl.inline_asm_elementwise(
        DOT8_LOAD_PTX, "=r,r,l", [words, addr], dtype=tl.float32, is_pure=True, pack=1
    )
