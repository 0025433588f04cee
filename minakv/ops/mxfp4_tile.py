"""MXFP4 weights dequantized in registers: what both MXFP4 MoE paths (mxfp4_fused.py, mxfp4_grouped.py) share.

The packed layout (minakv/ops/quant.py), one expert, one output row n of a weight W [out, in]:

    blocks u8 [E, out, in/32, 16]      row n:  | b0 b1 ... b15 | b16 ... b31 | ...   in/2 bytes
                                                 group 0         group 1
    byte j = (W[n, 2j + 1] << 4) | W[n, 2j]    two FP4 E2M1 codes, the LOW nibble is the even element
    scales u8 [E, out, in/32]          row n:  | s0 | s1 | ...   one E8M0 exponent per group of 32

    W[n, k] = fp4(code of k) * 2^(s[n, k // 32] - 127)

(The checkpoint's layout. Resident weights keep these bytes but in 16-row tiles, minakv/ops/mxfp4_layout.py,
where a row's group g sits 256 bytes after its group g-1: the loaders here step by its `byte_offsets`,
`group_offsets` and `scale_offsets`.) The weight tile for output rows n..n+BN and inputs k0..k0+BK is a
[BN, BK/2] byte tile plus a [BN, BK/32] scale tile: a quarter of the bf16 tile's bytes and 1/64 more for the scales.
`load_mxfp4_tile` loads both and expands them in registers, the weights never exist in bf16 in memory:

    bytes [BN, BK/2] --& 0xF--> even codes --+
                     --  >> 4-> odd codes  --+-- interleave --> codes [BN, BK] -- e2m1 --> values
    values.reshape(BN, BK/32, 32) * 2^(scales - 127)[:, :, None] --> W tile [BN, BK]

E2M1 (sign, 2 exponent bits, 1 mantissa bit; bias 1) decodes by building the float's bits, no table:
magnitude code m = e1 e0 m0 is 0, 0.5, 1, 1.5, 2, 3, 4, 6. For m >= 2 the code's bits are already an
exponent and a mantissa: shift them under the target format's mantissa and re-bias (+126), e.g. in bf16
`(m << 6) + (126 << 7)`. m = 1 (0.5, a subnormal in E2M1) and m = 0 are set apart by two selects.
The E8M0 scale is a bare exponent byte, so 2^(s - 127) is `s << 23` as an fp32 (`s << 7` as a bf16).
Both are exact: every FP4 value times a power of two is a bf16, so the dequantized tile equals
`dequantize_mxfp4` of the same bytes bit for bit (up to overflow).

K (the `in` dim) is a multiple of 32 by the format, not of the tile's BK (gpt-oss: 2880 = 90 * 32):
the tail tile is masked per byte and per group, masked bytes read 0 (the value 0).

The interleave above (join + reshape) costs layout shuffles in registers on every tile. The "split",
"swap" and "fma" modes (MODES) never build it ("swap" is "split" with the weight tile as the dot's left
operand, the one Hopper's MMA reads from registers; "fma" multiplies and sums without tensor cores): the low nibbles are the even inputs and the high nibbles the odd
ones, so with the activations split the same way (even / odd columns)

    A @ W^T = A[:, 0::2] @ W[:, 0::2]^T + A[:, 1::2] @ W[:, 1::2]^T

`load_mxfp4_halves` loads the bytes as [BN, BK/32, 16] (a group's 16 bytes are one 16-byte vector load,
its mask and its scale are the same for all of them) and returns the two halves [BN, BK/2]. Those decode
E2M1 without selects: the code's bits e1 e0 m0 put right under fp16's exponent are an fp16 equal to the
FP4 value times 2^-14 (code 1, 0.5, lands on the fp16 subnormal 2^-15, which a conversion keeps exact),
and the 2^14 is folded into the scale, 2^(s - 113).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minakv.ops.moe_groups import ACTIVATIONS
from minakv.ops.mxfp4_layout import byte_offsets, group_offsets, scale_offsets
from minakv.ops.triton_util import check, interpreting

# how the GEMMs consume a packed tile: 0 the interleaved tile and one tl.dot; 1 the even / odd halves and two
# tl.dot; 2 the halves with fp32 multiply-and-sum (no tensor cores: a dot pads one row to 16); 3 "split" with
# the weights as the dot's left operand; 4 the packed bytes and scales straight to tl.dot_scaled, which
# upcasts them in the MMA operand's own layout (bf16 activations only, see `scaled_mode`)
MODES = {"interleave": 0, "split": 1, "fma": 2, "swap": 3, "scaled": 4}
KEYS = ("gate_up_blocks", "gate_up_scales", "down_blocks", "down_scales")


def packed_shapes(x: torch.Tensor, w: dict[str, torch.Tensor], topk_ids: torch.Tensor, activation: str):
    """Validate the packed experts against x -> (num_experts, hidden H, intermediate I)."""
    check(
        activation in ACTIVATIONS, f"unknown MoE activation {activation!r} (expected 'silu' or 'swiglu_oai')"
    )
    missing = [key for key in KEYS if key not in w]
    check(not missing, f"packed MXFP4 experts lack {missing} (expected keys {KEYS})")
    gate_up, down = w["gate_up_blocks"], w["down_blocks"]
    check(gate_up.dim() == 4 and down.dim() == 4, "MXFP4 blocks must be [E, out, in/32, 16]")
    num_experts, two_i, h_groups, _ = gate_up.shape
    hidden, inter = h_groups * 32, two_i // 2
    check(
        x.dim() == 2 and x.shape[1] == hidden,
        f"x is {tuple(x.shape)}, expected [T, {hidden}]: MXFP4 needs the hidden size to be a multiple of 32",
    )
    check(
        inter % 32 == 0 and down.shape == (num_experts, hidden, inter // 32, 16),
        f"down_blocks is {tuple(down.shape)}, expected ({num_experts}, {hidden}, {inter // 32}, 16): "
        f"MXFP4 needs the intermediate size ({inter}) to be a multiple of 32",
    )
    for name in KEYS:
        t = w[name]
        check(t.dtype == torch.uint8, f"{name} must be uint8, got {t.dtype}")
        blocks = w[name.replace("scales", "blocks")]
        check(t.shape[:3] == blocks.shape[:3], f"{name} is {tuple(t.shape)}, blocks {tuple(blocks.shape)}")
        # the kernels walk a row's bytes (and scales) with unit stride
        inner = (16, 1) if name.endswith("blocks") else (1,)
        check(t.stride()[2:] == inner, f"{name} must be contiguous in its last dims, strides {t.stride()}")
    check(topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0], f"topk_ids is {tuple(topk_ids.shape)}")
    return num_experts, hidden, inter


def scaled_mode(mode: str, x: torch.Tensor) -> str:
    """`mode`, except "scaled" on activations that are not bf16: tl.dot_scaled takes bf16 activations
    (an fp32 or fp16 dot, as the CPU tests run, keeps the in-register "split" tiles)."""
    return "split" if mode == "scaled" and x.dtype != torch.bfloat16 else mode


def dot_dtypes(x: torch.Tensor) -> tuple[bool, bool]:
    """(dequantize straight to bf16, take the fp32 dot) for activations x. bf16 on the GPU: the tile is
    built in bf16 (a cvt less per weight). fp32, or the interpreter (which multiplies bf16 dots wrongly,
    see triton_util.interpreting, and garbles bitcasts to bf16): fp32 tiles and an exact fp32 dot. fp16:
    fp32 tiles cast to fp16."""
    f32_dot = x.dtype == torch.float32 or interpreting()
    return x.dtype == torch.bfloat16 and not f32_dot, f32_dot


@triton.jit
def e2m1_values(codes, BF16: tl.constexpr):
    """FP4 E2M1 codes (u8, 0..15) -> their values in bf16 or fp32, by building the bits."""
    if BF16:
        c = codes.to(tl.uint16)
        mag = c & 7
        bits = (mag << 6) + (126 << 7)
        bits = tl.where(mag < 2, tl.where(mag == 1, 126 << 7, 0), bits)  # 0.5 is 2^-1, 0 is all zeros
        values = (bits | ((c & 8) << 12)).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        c = codes.to(tl.uint32)
        mag = c & 7
        bits = (mag << 22) + (126 << 23)
        bits = tl.where(mag < 2, tl.where(mag == 1, 126 << 23, 0), bits)
        values = (bits | ((c & 8) << 28)).to(tl.uint32).to(tl.float32, bitcast=True)
    return values


@triton.jit
def e8m0_values(scales, BF16: tl.constexpr):
    """E8M0 exponent bytes s -> 2^(s - 127) in bf16 or fp32 (s = 0 is the subnormal 2^-127)."""
    if BF16:
        bits = tl.where(scales == 0, 0x0040, scales.to(tl.uint16) << 7)
        values = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        bits = tl.where(scales == 0, 0x00400000, scales.to(tl.uint32) << 23)
        values = bits.to(tl.uint32).to(tl.float32, bitcast=True)
    return values


@triton.jit
def load_mxfp4_tile(byte_rows, scale_rows, row_ok, k0, K, BLOCK_K: tl.constexpr, BF16: tl.constexpr):  # fmt: skip
    """W[rows, k0 : k0 + BLOCK_K] dequantized -> [BN, BLOCK_K] (0 past K and on masked rows).

    byte_rows / scale_rows: [BN, 1] pointers to the first byte / scale of each output row
    (mxfp4_layout.packed_rows), the weights in tiles (mxfp4_layout.py)."""
    tl.static_assert(BLOCK_K % 32 == 0, "BLOCK_K must be a multiple of the MXFP4 group (32)")
    BN: tl.constexpr = byte_rows.shape[0]
    offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(
        byte_rows + byte_offsets(offs_b)[None, :],
        mask=row_ok[:, None] & (offs_b < K // 2)[None, :],
        other=0,
    )
    offs_g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    scale = tl.load(
        scale_rows + scale_offsets(offs_g)[None, :],
        mask=row_ok[:, None] & (offs_g < K // 32)[None, :],
        other=127,
    )
    values = tl.interleave(e2m1_values(packed & 0xF, BF16), e2m1_values(packed >> 4, BF16))
    values = tl.reshape(values, (BN, BLOCK_K // 32, 32)) * e8m0_values(scale, BF16)[:, :, None]
    return tl.reshape(values, (BN, BLOCK_K))


@triton.jit
def dot_wt(a, w, acc, F32_DOT: tl.constexpr):
    """acc + a @ w^T, w a dequantized (out, in) tile."""
    if F32_DOT:  # fp32 activations (or the interpreter): exact fp32 products, not tf32
        return tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(a, tl.trans(w.to(a.dtype)), acc)


@triton.jit
def dot_wa(w, a, acc, F32_DOT: tl.constexpr):
    """(acc +) w @ a^T -> [BN, BM]: the dequantized tile is the left operand, which Hopper's MMA can take
    straight from registers (the right one goes through shared memory: here the few activation rows)."""
    if F32_DOT:
        out = tl.dot(w.to(tl.float32), tl.trans(a.to(tl.float32)), acc, input_precision="ieee")
    else:
        out = tl.dot(w.to(a.dtype), tl.trans(a), acc)
    return out


@triton.jit
def e2m1_f16(codes):
    """FP4 E2M1 codes (0..15) -> fp16 equal to the FP4 value times 2^-14 (module docstring), no selects."""
    c = codes.to(tl.uint16)
    return (((c & 7) << 9) | ((c & 8) << 12)).to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def load_mxfp4_halves(byte_rows, scale_rows, row_ok, k0, K, BLOCK_K: tl.constexpr, BF16: tl.constexpr):  # fmt: skip
    """W[rows, k0 : k0 + BLOCK_K] dequantized, as its even and odd columns -> two [BN, BLOCK_K / 2] tiles in
    bf16 or fp32 (0 past K and on masked rows). byte_rows / scale_rows as in `load_mxfp4_tile`."""
    tl.static_assert(BLOCK_K % 32 == 0, "BLOCK_K must be a multiple of the MXFP4 group (32)")
    BN: tl.constexpr = byte_rows.shape[0]
    G: tl.constexpr = BLOCK_K // 32
    offs_g = k0 // 32 + tl.arange(0, G)
    g_ok = row_ok[:, None] & (offs_g < K // 32)[None, :]  # [BN, G]: masks whole groups, keeps vector loads
    ptrs = byte_rows[:, :, None] + group_offsets(offs_g, 1)[None, :, None] + tl.arange(0, 16)[None, None, :]
    packed = tl.load(ptrs, mask=g_ok[:, :, None], other=0)
    s = tl.load(scale_rows + scale_offsets(offs_g)[None, :], mask=g_ok, other=0).to(tl.uint32)
    s += 14  # 2^(s - 127) * 2^14
    if BF16:
        scale = (s << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        lo = e2m1_f16(packed & 0xF).to(tl.bfloat16) * scale[:, :, None]
        hi = e2m1_f16(packed >> 4).to(tl.bfloat16) * scale[:, :, None]
    else:
        scale = (s << 23).to(tl.float32, bitcast=True)
        lo = e2m1_f16(packed & 0xF).to(tl.float32) * scale[:, :, None]
        hi = e2m1_f16(packed >> 4).to(tl.float32) * scale[:, :, None]
    return tl.reshape(lo, (BN, BLOCK_K // 2)), tl.reshape(hi, (BN, BLOCK_K // 2))


@triton.jit
def load_act(a_rows, m_ok, k0, K, BLOCK_K: tl.constexpr, MODE: tl.constexpr, A_SPLIT: tl.constexpr):
    """Activations A[rows, k0 : k0 + BLOCK_K] for `mxfp4_acc` -> (a, a) in modes 0 and 4, else (even, odd
    columns).
    a_rows: [BM, 1] row pointers; A_SPLIT: the row is stored [even columns | odd columns] (h, written so by
    the first kernel), else interleaved as usual (x: read with stride 2, its rows are small and cached)."""
    # (one return per static branch: compiled Triton checks every return it visits for the same type)
    if MODE == 0 or MODE == 4:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        even = tl.load(a_rows + offs_k[None, :], mask=m_ok[:, None] & (offs_k < K)[None, :], other=0.0)
        odd = even
    else:
        offs_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        mask = m_ok[:, None] & (offs_j < K // 2)[None, :]
        if A_SPLIT:
            even = tl.load(a_rows + offs_j[None, :], mask=mask, other=0.0)
            odd = tl.load(a_rows + K // 2 + offs_j[None, :], mask=mask, other=0.0)
        else:
            even = tl.load(a_rows + 2 * offs_j[None, :], mask=mask, other=0.0)
            odd = tl.load(a_rows + 2 * offs_j[None, :] + 1, mask=mask, other=0.0)
    return even, odd


@triton.jit
def mxfp4_acc(a0, a1, byte_rows, scale_rows, row_ok, k0, K, acc, BLOCK_K: tl.constexpr, BF16: tl.constexpr,
              F32_DOT: tl.constexpr, MODE: tl.constexpr):  # fmt: skip
    """acc [BM, BN] + A[:, k0 : k0 + BLOCK_K] @ W[rows, k0 : k0 + BLOCK_K]^T, (a0, a1) from `load_act`."""
    if MODE == 0:
        w = load_mxfp4_tile(byte_rows, scale_rows, row_ok, k0, K, BLOCK_K, BF16)
        out = dot_wt(a0, w, acc, F32_DOT)
    elif MODE == 4:
        out = dot_packed(a0, byte_rows, scale_rows, row_ok, k0, K, acc, BLOCK_K)
    elif MODE == 1:
        w0, w1 = load_mxfp4_halves(byte_rows, scale_rows, row_ok, k0, K, BLOCK_K, BF16)
        out = dot_wt(a1, w1, dot_wt(a0, w0, acc, F32_DOT), F32_DOT)
    elif MODE == 3:  # the weights as the left operand: Hopper's wgmma reads that one from registers
        w0, w1 = load_mxfp4_halves(byte_rows, scale_rows, row_ok, k0, K, BLOCK_K, BF16)
        out = acc + tl.trans(dot_wa(w0, a0, dot_wa(w1, a1, None, F32_DOT), F32_DOT))
    else:
        w0, w1 = load_mxfp4_halves(byte_rows, scale_rows, row_ok, k0, K, BLOCK_K, False)
        prod = a0.to(tl.float32)[:, None, :] * w0[None, :, :] + a1.to(tl.float32)[:, None, :] * w1[None, :, :]
        out = acc + tl.sum(prod, 2)
    return out


@triton.jit
def dot_packed(a, byte_rows, scale_rows, row_ok, k0, K, acc, BLOCK_K: tl.constexpr):
    """acc + a @ W[rows, k0 : k0 + BLOCK_K]^T by tl.dot_scaled: the bytes go in as the [BLOCK_K / 2, BN] e2m1
    operand (our packing is the OCP one it expects: the low nibble is the even input) with the [BN,
    BLOCK_K / 32] E8M0 scales. Triton loads the bytes to shared memory in its pipeline, reads them in the
    MMA operand's layout and upcasts there, so no dequantized tile is ever shuffled between layouts."""
    tl.static_assert(BLOCK_K % 32 == 0, "BLOCK_K must be a multiple of the MXFP4 group (32)")
    offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    bytes_t = tl.load(
        tl.trans(byte_rows) + byte_offsets(offs_b)[:, None],
        mask=row_ok[None, :] & (offs_b < K // 2)[:, None],
        other=0,
    )
    offs_g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    scales = tl.load(
        scale_rows + scale_offsets(offs_g)[None, :],
        mask=row_ok[:, None] & (offs_g < K // 32)[None, :],
        other=0,
    )
    return tl.dot_scaled(a, None, "bf16", bytes_t, scales, "e2m1", acc)


@triton.jit
def split_col(offs_n, N, MODE: tl.constexpr):
    """Where column n of an [.., N] row goes: stored split ([even columns | odd columns]) for the modes that
    read activations as halves (1-3), in place for the others."""
    if MODE == 0 or MODE == 4:
        cols = offs_n
    else:
        cols = (offs_n % 2) * (N // 2) + offs_n // 2
    return cols
