"""The narrow seam between the model and the KV cache: an attention context.

A model forward takes a flat batch of tokens (no batch dimension; tokens of many requests side by side)
and a context. The model computes q, k, v for every token and hands them, *un-rotated*, to
`ctx.attend(layer, q, k, v)`. The context owns everything about where keys live and which positions they
have: it applies RoPE at the positions it assigns, stores K/V (a dense buffer, the paged pool, or the
walk oracle's explicit active set), and computes attention with the layer's window and sinks. So the
same model code serves the paged engine and the references of `minakv/reference/` (a dense cache for
parity tests, the walk oracle).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from minakv.ops.rope import Rope


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
