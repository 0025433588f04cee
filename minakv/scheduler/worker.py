"""The worker: owns the model and the KV tensors, and turns one `ForwardBatch` into sampled tokens.

Its interface is deliberately narrow (a batch in, tokens out) so that prefill and decode workers can
later run in separate processes. It knows nothing of requests beyond the per-request sampler state
(seeded generators), which must live where sampling happens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minakv.model import CausalLM
from minakv.ops.rerotate import rerotate_copy
from minakv.sampling import TokenLogprob
from minakv.scheduler.batch import ForwardBatch, PagedContext
from minakv.scheduler.sampler import sample


@dataclass
class StepResult:
    tokens: list[int]  # one per sample row
    logprobs: list[TokenLogprob | None]


def kv_bytes_per_token(model: CausalLM, dtype: torch.dtype) -> int:
    c = model.config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * torch.tensor([], dtype=dtype).element_size()


class Worker:
    def __init__(self, model: CausalLM, num_slots: int, kv_dtype: torch.dtype | None = None) -> None:
        self.model = model
        c = model.config
        device = next(model.parameters()).device
        self.device = device
        self.kv_dtype = kv_dtype or model.embed_tokens.weight.dtype
        shape = (c.num_layers, num_slots, c.num_kv_heads, c.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.kv_dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=self.kv_dtype, device=device)
        self.generators: dict[str, torch.Generator] = {}

    @torch.inference_mode()
    def step(self, batch: ForwardBatch) -> StepResult:
        for rid in batch.release_ids:
            self.generators.pop(rid, None)
        src, dst, old, new = batch.rerotate
        if src:
            as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=self.device)
            rerotate_copy(
                self.k_cache, self.v_cache, as_tensor(src), as_tensor(dst), as_tensor(old), as_tensor(new),
                self.model.rope,
            )  # fmt: skip
        if not batch.num_tokens:
            return StepResult([], [])
        ids = torch.tensor(batch.input_ids, dtype=torch.int64, device=self.device)
        hidden = self.model(ids, PagedContext(batch, self.k_cache, self.v_cache))
        if not batch.sample_rows:
            return StepResult([], [])
        rows = torch.tensor(batch.sample_rows, dtype=torch.int64, device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        gens = [self._generator(rid, p.seed) for rid, p in zip(batch.sample_ids, batch.sample_params)]
        tokens, logprobs = sample(logits, batch.sample_params, gens)
        return StepResult(tokens, logprobs)

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        if request_id not in self.generators:
            self.generators[request_id] = torch.Generator().manual_seed(seed)
        return self.generators[request_id]
