"""Quantised weight formats of the two checkpoints: MXFP4 (GPT-OSS experts) and FP8 with 128x128 block
scales (MiniMax-M2), each as a dequantiser (used by the loader) and the matching quantiser (used by tests
and the tiny-checkpoint builder to write checkpoints in the real layouts).

MXFP4: a weight W [E, out, in] is cut into groups of 32 along `in`. Each group stores 16 bytes of FP4 E2M1
codes (two per byte; the LOW nibble is the even element) and one E8M0 scale byte s meaning 2^(s - 127):
`blocks` u8 [E, out, in/32, 16], `scales` u8 [E, out, in/32].

FP8 block: W [out, in] stored as float8_e4m3fn plus `scale_inv` f32 [ceil(out/b), ceil(in/b)] (b = 128);
despite its name scale_inv is a multiplier: W[i, j] = Wq[i, j] * scale_inv[i // b, j // b].
"""

from __future__ import annotations

import math

import torch

# FP4 E2M1 code -> value; bit 3 is the sign.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """blocks u8 [..., G, 16], scales u8 [..., G] -> W [..., G * 32] (on blocks' device)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    low, high = blocks & 0x0F, blocks >> 4
    codes = torch.stack([low, high], dim=-1).flatten(-2).long()  # [..., G, 32]: low nibble first
    values = lut[codes] * torch.exp2(scales.float() - 127.0)[..., None]
    return values.flatten(-2).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [..., in] (in a multiple of 32) -> (blocks u8 [..., in/32, 16], scales u8 [..., in/32]).

    Per group the exponent is ceil(log2(amax / 6)) so the largest value fits in FP4's range; each value
    gets the nearest FP4 code. Quantising a dequantised weight gives back the same values."""
    if w.shape[-1] % 32:
        raise ValueError(f"MXFP4 needs the input dim to be a multiple of 32, got shape {tuple(w.shape)}")
    groups = w.float().reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = groups.abs().amax(dim=-1)
    exp = torch.ceil(torch.log2(amax / 6.0)).nan_to_num(0.0, posinf=0.0, neginf=-127.0).clamp(-127, 127)
    scaled = groups / torch.exp2(exp)[..., None]
    mags = torch.tensor(FP4_VALUES[:8], dtype=torch.float32, device=w.device)
    codes = (scaled.abs()[..., None] - mags).abs().argmin(dim=-1)  # nearest magnitude, 0..7
    codes = codes | ((scaled < 0).long() << 3)
    codes = codes.to(torch.uint8).reshape(*groups.shape[:-1], 16, 2)
    blocks = codes[..., 0] | (codes[..., 1] << 4)
    return blocks, (exp + 127).to(torch.uint8)


def _expand_scales(scale: torch.Tensor, shape: torch.Size, block: int) -> torch.Tensor:
    out, inp = shape
    return scale.repeat_interleave(block, 0)[:out].repeat_interleave(block, 1)[:, :inp]


def dequantize_fp8_block(
    w: torch.Tensor, scale_inv: torch.Tensor, block: int = 128, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """w float8 [out, in], scale_inv [ceil(out/block), ceil(in/block)] -> W [out, in]."""
    grid = (math.ceil(w.shape[0] / block), math.ceil(w.shape[1] / block))
    if w.dim() != 2 or tuple(scale_inv.shape) != grid:
        raise ValueError(
            f"FP8 weight {tuple(w.shape)} needs weight_scale_inv of shape {grid} for {block}x{block} blocks, "
            f"got {tuple(scale_inv.shape)}"
        )
    scale = _expand_scales(scale_inv.to(w.device, torch.float32), w.shape, block)
    return (w.float() * scale).to(dtype)


def quantize_fp8_block(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] -> (float8_e4m3fn [out, in], scale_inv f32 [ceil(out/block), ceil(in/block)]) with
    scale = amax / 448 per block (1 for an all-zero block)."""
    out, inp = w.shape
    wf = w.float()
    rows, cols = math.ceil(out / block), math.ceil(inp / block)
    padded = torch.zeros(rows * block, cols * block, dtype=torch.float32, device=w.device)
    padded[:out, :inp] = wf
    amax = padded.reshape(rows, block, cols, block).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (wf / _expand_scales(scale, w.shape, block)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale
