"""The walk oracle: docs/design.md 2.3 executed literally, one token at a time. Slow on purpose.

It is both an attention context and the loop that drives the model. It keeps, per layer, the RAW
(un-rotated) K and V of every token, an explicit active set (token indices in logical order) and the
explicit current position of every token. For each token i:

    1. apply the drops whose insertion point is i   (those tokens leave the active set)
    2. apply the reposition at i, if any            (active tokens get positions 0..A-1; next_pos = A)
    3. token i is born at next_pos (next_pos += 1) and joins the active set
    4. its query attends to the active set, each key rotated at its CURRENT position,
       with the layer's window measured in positions and its sinks

Generated tokens continue the same loop. Nothing here is clever: the engine, the segment executor and the
restore passes are all checked against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from minakv.cache.program import CacheOpError, Program
from minakv.model.context import AttentionLayer
from minakv.ops.attention import masked_attention, position_mask
from minakv.ops.rope import apply_rope


@dataclass
class OracleRun:
    logits: torch.Tensor  # float32 [T + G, V]: row i = the next-token logits after token i
    generated: list[int]  # the G generated (or forced) tokens
    logprobs: list[float] = field(default_factory=list)  # log p(generated[j]) under row T - 1 + j


class WalkOracle:
    def __init__(self, model: torch.nn.Module, program: Program) -> None:
        self.model = model
        self.program = program
        self.raw_k: dict[int, dict[int, torch.Tensor]] = {}  # layer -> token -> [Hkv, D], un-rotated
        self.raw_v: dict[int, dict[int, torch.Tensor]] = {}
        self.active: list[int] = []  # token indices, logical order
        self.position: dict[int, int] = {}  # token -> current position (dropped tokens keep their last)
        self.next_pos = 0
        self.current = -1  # the token whose query runs now
        # Where the operations happen (docs/design.md 2.2): at the first token after the message.
        owners = program.owners.tolist()

        def first_token_after(m: int) -> int:
            return next((i for i, o in enumerate(owners) if o > m), len(owners))

        self.drops_at: dict[int, list[int]] = {}  # point -> messages dropped there
        for trigger, ids in program.drops.items():
            self.drops_at.setdefault(first_token_after(trigger), []).extend(ids)
        self.repositions_at = {first_token_after(m) for m in program.repositions}

    # -- the walk -------------------------------------------------------------------------------------

    def apply_events(self, i: int) -> None:
        owners = self.program.owners
        for m in self.drops_at.get(i, []):  # drops first (a message already dropped is simply absent)
            self.active = [t for t in self.active if t >= len(owners) or owners[t] != m]
        if i in self.repositions_at:  # then the reposition: rank among active tokens, in logical order
            if not self.active:
                raise CacheOpError(f"reposition at token {i}: nothing is active")
            for rank, t in enumerate(self.active):
                self.position[t] = rank
            self.next_pos = len(self.active)

    def step(self, i: int, token: int) -> torch.Tensor:
        """Token i is born and its query runs; returns its float32 logits [V]."""
        self.apply_events(i)
        self.position[i] = self.next_pos
        self.next_pos += 1
        self.active.append(i)
        self.current = i
        device = self.model.embed_tokens.weight.device
        hidden = self.model(torch.tensor([token], dtype=torch.long, device=device), self)
        return self.model.compute_logits(hidden)[0]

    @torch.inference_mode()
    def run(self, prompt: list[int], max_new_tokens: int = 0, forced: list[int] | None = None) -> OracleRun:
        """Run the prompt, then greedy generation (or the `forced` tokens) for max_new_tokens steps."""
        if len(prompt) != self.program.num_tokens:
            raise ValueError(f"prompt has {len(prompt)} tokens, the program {self.program.num_tokens}")
        rows = [self.step(i, token) for i, token in enumerate(prompt)]
        generated: list[int] = []
        logprobs: list[float] = []
        steps = max_new_tokens if forced is None else len(forced)
        for j in range(steps):
            token = int(rows[-1].argmax()) if forced is None else forced[j]
            logprobs.append(float(torch.log_softmax(rows[-1].double(), dim=-1)[token]))
            generated.append(token)
            rows.append(self.step(len(prompt) + j, token))
        if not steps:
            self.apply_events(len(prompt))  # trailing events still shape the final state
        return OracleRun(torch.stack(rows) if rows else torch.zeros(0), generated, logprobs)

    # -- the attention context ------------------------------------------------------------------------

    def attend(
        self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        i = self.current
        self.raw_k.setdefault(layer.index, {})[i] = k[0]
        self.raw_v.setdefault(layer.index, {})[i] = v[0]
        keys, values = self.kv(layer.index, self.active, layer=layer)
        k_pos = torch.tensor([self.position[t] for t in self.active], device=q.device)
        q_pos = torch.tensor([self.position[i]], device=q.device)
        q = apply_rope(q, *layer.rope.cos_sin(q_pos))
        mask = position_mask(q_pos, k_pos, layer.window)
        return masked_attention(q, keys, values, mask, layer.scale, layer.sinks)

    # -- reading the state ------------------------------------------------------------------------------

    def kv(
        self, layer_index: int, tokens: list[int] | np.ndarray, layer: AttentionLayer | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K rotated at each token's current position (for dropped tokens: their last one) and V."""
        tokens = [int(t) for t in tokens]
        rope = (layer or self.model.layers[layer_index].self_attn.spec).rope
        k = torch.stack([self.raw_k[layer_index][t] for t in tokens])
        v = torch.stack([self.raw_v[layer_index][t] for t in tokens])
        pos = torch.tensor([self.position[t] for t in tokens], device=k.device)
        return apply_rope(k, *rope.cos_sin(pos)), v

    def raw_kv(self, layer_index: int, tokens: list[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = [int(t) for t in tokens]
        return (torch.stack([self.raw_k[layer_index][t] for t in tokens]),
                torch.stack([self.raw_v[layer_index][t] for t in tokens]))  # fmt: skip
