"""Rotary position embeddings: apply, and re-rotate a key from one position to another.

RoPE rotates pairs of dims (i, i + rotary_dim/2) of each head by angle `pos * inv_freq[i]` (NeoX
half-split layout). Only the first `rotary_dim` dims rotate (partial RoPE); the rest pass through.
YaRN changes `inv_freq` and multiplies cos and sin by an amplitude `attention_factor`, so a rotated
vector is longer than the raw one by that factor.

Re-rotation is the operation behind `reposition`: a cached key rotated at position p becomes the key
at position p'. Undo the old rotation exactly (the inverse of a scaled rotation divides by
cos^2 + sin^2), then apply the new one, in fp32. Equal positions give a bit-identical copy.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(
    rotary_dim: int, theta: float, scaling: dict[str, Any] | None
) -> tuple[torch.Tensor, float]:
    """The inverse frequencies (float32, [rotary_dim / 2]) and the cos/sin amplitude factor."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling.get("rope_type", "default")
    if kind != "yarn":
        raise ValueError(f"unsupported rope_scaling.rope_type {kind!r} (minakv supports yarn)")
    factor = float(scaling["factor"])
    beta_fast = float(scaling.get("beta_fast", 32.0))
    beta_slow = float(scaling.get("beta_slow", 1.0))
    original = scaling["original_max_position_embeddings"]
    truncate = scaling.get("truncate", True)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def correction_dim(rotations: float) -> float:
        return (rotary_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_interp = inv_freq / factor
    inv_freq = inv_interp * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq, float(attention_factor)


class Rope:
    """cos/sin tables for one model: `cos_sin(positions)` -> two float32 [T, rotary_dim / 2] tensors."""

    def __init__(self, rotary_dim: int, theta: float, scaling: dict[str, Any] | None = None):
        self.rotary_dim = rotary_dim
        self.inv_freq, self.attention_factor = rope_inv_freq(rotary_dim, theta, scaling)
        self._on_device: dict[torch.device, torch.Tensor] = {}  # a copy per device: no transfer per call

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self._on_device.get(positions.device)
        if inv_freq is None:
            inv_freq = self._on_device[positions.device] = self.inv_freq.to(positions.device)
        angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by cos/sin [T, R/2] (R = rotary dims); dims past R pass through."""
    half = cos.shape[-1]
    xf = x.float()
    x1, x2, rest = xf[..., :half], xf[..., half : 2 * half], xf[..., 2 * half :]
    c, s = cos[:, None, :], sin[:, None, :]
    out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)
    return out.to(x.dtype)


def rerotate(
    k: torch.Tensor, old: tuple[torch.Tensor, torch.Tensor], new: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Move keys k [T, H, D] rotated with `old` (cos, sin) to `new` (cos, sin), in fp32.

    Reference for the Triton re-rotation kernel. Rows whose old and new cos/sin are equal are copied bit
    for bit, so a reposition that moves nothing changes nothing.
    """
    oc, os_ = old[0][:, None, :], old[1][:, None, :]
    nc, ns = new[0][:, None, :], new[1][:, None, :]
    half = oc.shape[-1]
    kf = k.float()
    y1, y2, rest = kf[..., :half], kf[..., half : 2 * half], kf[..., 2 * half :]
    norm = oc * oc + os_ * os_
    x1 = (y1 * oc + y2 * os_) / norm
    x2 = (y2 * oc - y1 * os_) / norm
    out = torch.cat([x1 * nc - x2 * ns, x2 * nc + x1 * ns, rest], dim=-1).to(k.dtype)
    same = ((old[0] == new[0]) & (old[1] == new[1])).all(dim=-1)
    return torch.where(same[:, None, None], k, out)
