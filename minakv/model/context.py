"""The narrow seam between the model and the KV cache: an attention context.

A model forward takes a flat batch of tokens (no batch dimension; tokens of many requests side by side)
and a context. The model computes q, k, v for every token and hands them, *un-rotated*, to
`ctx.attend(layer, q, k, v)`. The context owns everything about where keys live and which positions they
have: it applies RoPE at the positions it assigns, stores K/V (a dense buffer, the paged pool, or the
walk oracle's explicit active set), and computes attention with the layer's window and sinks. So the
same model code serves parity tests, the walk oracle, restore passes and the paged engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from minakv.ops.attention import masked_attention, position_mask
from minakv.ops.rope import Rope, apply_rope


@dataclass
class AttentionLayer:
    """What a context needs to know about one attention layer."""

    index: int
    window: int | None  # sliding window in positions, or None for full attention
    sinks: torch.Tensor | None  # [num_heads] learned logits, or None
    scale: float
    rope: Rope


class AttentionContext(Protocol):
    def attend(
        self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q [T, Hq, D], k and v [T, Hkv, D], un-rotated -> attention output [T, Hq, D]."""
        ...


class DenseContext:
    """One sequence in a contiguous cache: prefill, then incremental decode steps.

    Call `advance(n)` before each forward of n new tokens; they get the next n positions. Used by parity
    tests against transformers and by `Model.generate_simple`; the engine uses the paged pool instead.
    """

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.length = 0
        self.positions = torch.zeros(0, dtype=torch.long)

    def advance(self, n: int) -> None:
        self.positions = torch.arange(self.length, self.length + n)
        self.length += n

    def attend(
        self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        pos = self.positions.to(q.device)
        cos, sin = layer.rope.cos_sin(pos)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if layer.index in self.k:
            k = torch.cat([self.k[layer.index], k])
            v = torch.cat([self.v[layer.index], v])
        self.k[layer.index], self.v[layer.index] = k, v
        k_pos = torch.arange(k.shape[0], device=q.device)
        mask = position_mask(pos, k_pos, layer.window)
        return masked_attention(q, k, v, mask, layer.scale, layer.sinks)
