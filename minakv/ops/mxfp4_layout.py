"""Where a resident MXFP4 weight's bytes sit in memory: 16-row tiles of the checkpoint's rows.

Rows (the checkpoint's, minakv/ops/quant.py): one output row's groups one after another, then the next row.

    blocks [E, R, G, 16]   row 0: | g0 | g1 | ... | g(G-1) |  row 1: | g0 | g1 | ...     16 bytes a group
    scales [E, R, G]       row 0: | s0 | s1 | ... |            one E8M0 byte a group

Tiles (`tile`): the same bytes and shapes, but inside each block of 16 rows the groups come first, so one
group of the 16 rows is 256 contiguous bytes (its 16 scales: 16 contiguous bytes):

    tile of rows 16t .. 16t + 15:  | g0 of rows 0..15 | g1 of rows 0..15 | ...      256 bytes a group
                                     r0 r1 ... r15       r0 r1 ... r15              16 bytes a row

    byte c of row n:  tile (n // 16) * 16 * G * 16  +  (c // 16) * 256  +  (n % 16) * 16  +  c % 16
    scale g of row n: tile (n // 16) * 16 * G       +  g * 16           +  n % 16

Why: the decode GEMVs hand 16 rows x 1 group to the tensor cores at a time (mxfp4_mma.py). In rows, the
warp's loads for one group touch 16 rows 1,440 bytes apart (gpt-oss); in tiles, one 256-byte run, and a
step of 4 groups is 1 KB in a row. On the H100 that took the one-token GEMV from 34% to 36% of the copy
bandwidth, 4 tokens from 52% to 62%, the grouped GEMM at 64 tokens of 120b from 42% to 88%, and
gpt-oss-120b's decode step from 2.834 to 2.691 ms at batch 1 and from 75.8 to 37.8 at batch 64
(bench/RESULTS.md, "16-row tiles"). So the loader (and the dummy weights) store tiles, every MXFP4 kernel
reads them, and only the dequantize-to-bf16 paths (the CPU reference, prefill's dequantize-once mode) go
back to rows (`untile_rows`, a copy).

A row's first byte in tiles is `(n - n % 16) * row_bytes + (n % 16) * 16`, so code that steps whole tiles
of 16 rows (gate's rows to up's, I apart, I a multiple of 16) keeps its row arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minakv.ops.triton_util import check

TILE = 16  # rows a tile


def tile_blocks(blocks: torch.Tensor, back: bool = False) -> torch.Tensor:
    """Blocks [..., R, G, 16] from rows to tiles (back: from tiles to rows), same shape (a copy)."""
    *lead, r, g, _ = blocks.shape
    check(r % TILE == 0, f"{r} rows do not split into {TILE}-row tiles")
    split = (TILE, g) if not back else (g, TILE)  # the two dims swapped, in the order they are stored
    return blocks.reshape(*lead, r // TILE, *split, 16).transpose(-3, -2).contiguous().view(blocks.shape)


def tile_scales(scales: torch.Tensor, back: bool = False) -> torch.Tensor:
    """Scales [..., R, G] from rows to tiles (back: from tiles to rows), same shape (a copy)."""
    *lead, r, g = scales.shape
    check(r % TILE == 0, f"{r} rows do not split into {TILE}-row tiles")
    split = (TILE, g) if not back else (g, TILE)
    return scales.reshape(*lead, r // TILE, *split).transpose(-2, -1).contiguous().view(scales.shape)


def tile(
    blocks: torch.Tensor, scales: torch.Tensor, back: bool = False, parts: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """One weight's blocks and scales from rows to tiles (back: from tiles to rows). parts: the weight
    stacks that many matrices of equal rows (gate_up: 2), each of which must be whole tiles."""
    r = blocks.shape[-3]
    check(r % (parts * TILE) == 0, f"{r} rows do not split into {parts} parts of whole {TILE}-row tiles")
    return tile_blocks(blocks, back), tile_scales(scales, back)


def _relay(w: dict[str, torch.Tensor], back: bool) -> dict[str, torch.Tensor]:
    out = dict(w)
    for name in ("gate_up", "down"):
        out[f"{name}_blocks"], out[f"{name}_scales"] = tile(
            w[f"{name}_blocks"], w[f"{name}_scales"], back, parts=2 if name == "gate_up" else 1
        )
    return out


def tile_rows(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The packed weights (gate_up_/down_ blocks and scales) re-laid from rows to tiles, same shapes (a copy;
    other keys passed through)."""
    return _relay(w, back=False)


def untile_rows(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tile_rows` undone: tiles back to the checkpoint's rows (a copy)."""
    return _relay(w, back=True)


@triton.jit
def row_starts(blocks_ptr, scales_ptr, expert, rows, stride_be, stride_bn, stride_se, stride_sn,
               UNIT: tl.constexpr):  # fmt: skip
    """Pointers to group 0 of each of `rows` of the expert -> (blocks, scales). Strides in elements of the
    blocks' view: UNIT bytes each (1: u8, 4: the 16 bytes of a group as 4 int32 words)."""
    e = expert.to(tl.int64)
    first = (rows - rows % 16).to(tl.int64)  # the tile's first row
    b = blocks_ptr + e * stride_be + first * stride_bn + (rows % 16) * (16 // UNIT)
    s = scales_ptr + e * stride_se + first * stride_sn + rows % 16
    return b, s


@triton.jit
def packed_rows(blocks_ptr, scales_ptr, expert, n0, N, stride_be, stride_bn, stride_se, stride_sn,
                BLOCK_N: tl.constexpr):  # fmt: skip
    """Output columns n0 .. n0 + BLOCK_N - 1 (and which are < N), with the [BLOCK_N, 1] pointers to the
    expert's packed rows for them (weights stored (out, in): a row per output column)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    b, s = row_starts(blocks_ptr, scales_ptr, expert, offs_n, stride_be, stride_bn, stride_se, stride_sn, 1)
    return offs_n, offs_n < N, b[:, None], s[:, None]


@triton.jit
def byte_offsets(offs_b):
    """Offsets from a row's first byte of its bytes offs_b (counted along the row)."""
    return (offs_b // 16) * 256 + offs_b % 16


@triton.jit
def group_offsets(offs_g, UNIT: tl.constexpr):
    """Offsets from a row's first byte of its groups offs_g, in elements of UNIT bytes (as `row_starts`)."""
    return offs_g * (256 // UNIT)


@triton.jit
def scale_offsets(offs_g):
    """Offsets from a row's first scale of its groups offs_g' scales."""
    return offs_g * 16
