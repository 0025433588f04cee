"""The simplest attention context: one sequence in a contiguous cache, and a greedy loop over it.

No pages, no operations: positions are 0, 1, 2, ... This is what transformers computes, so the parity tests
compare the model against transformers through it, independently of the engine's paged machinery.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from minakv.model.context import AttentionLayer
from minakv.model.layers import CausalLM
from minakv.ops.attention import masked_attention, position_mask
from minakv.ops.rope import apply_rope


class DenseContext:
    """One sequence in a contiguous cache: prefill, then incremental decode steps.

    Call `advance(n)` before each forward of n new tokens; they get the next n positions. Used by the
    parity tests against transformers and the whole-model benchmark; the engine uses the paged pool.
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


@torch.inference_mode()
def generate_greedy(
    model: CausalLM, prompt_ids: Iterable[int], max_new_tokens: int, stop_ids: Iterable[int] | None = None
) -> list[int]:
    """Greedy decoding of one sequence with a DenseContext; returns the new tokens (a stop token, by
    default one of the config's eos ids, is included and ends the loop)."""
    stop = set(model.config.eos_token_ids if stop_ids is None else stop_ids)
    device = model.embed_tokens.weight.device
    ids = torch.tensor(list(prompt_ids), dtype=torch.long, device=device)
    if ids.numel() == 0:
        raise ValueError("generate_greedy needs a non-empty prompt")
    ctx = DenseContext()
    out: list[int] = []
    for _ in range(max_new_tokens):
        ctx.advance(ids.numel())
        hidden = model(ids, ctx)
        token = int(model.compute_logits(hidden[-1:]).argmax(dim=-1))
        out.append(token)
        if token in stop:
            break
        ids = torch.tensor([token], dtype=torch.long, device=device)
    return out
