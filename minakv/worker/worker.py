"""The worker: owns the model and the KV tensors, and turns one `ForwardBatch` into sampled tokens.

Its interface is deliberately narrow (a batch in, tokens out) so that prefill and decode workers can
later run in separate processes. It knows nothing of requests beyond the per-request sampler state
(seeded generators), which must live where sampling happens.

On CUDA, decode-only steps replay CUDA graphs (minakv/worker/graphs.py); the pool has one scratch slot
past its end for the graphs' padding rows. A step reads results back to the host once: greedy rows are
answered by one batched argmax (and one batched log-softmax when logprobs are asked for).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from minakv.model import CausalLM
from minakv.ops.rerotate import rerotate_copy
from minakv.outputs import TokenLogprob
from minakv.params import SamplingParams
from minakv.worker.batch import ForwardBatch
from minakv.worker.graphs import DecodeGraphs
from minakv.worker.paged import PagedContext
from minakv.worker.sampler import sample


@dataclass
class StepResult:
    tokens: list[int]  # one per sample row
    logprobs: list[TokenLogprob | None]


def kv_bytes_per_token(model: CausalLM, dtype: torch.dtype) -> int:
    c = model.config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * torch.tensor([], dtype=dtype).element_size()


class Worker:
    def __init__(
        self,
        model: CausalLM,
        num_slots: int,
        kv_dtype: torch.dtype | None = None,
        cuda_graphs: bool = True,  # CUDA only; MINAKV_CUDA_GRAPHS=0 also turns them off
    ) -> None:
        self.model = model
        c = model.config
        device = next(model.parameters()).device
        self.device = device
        self.kv_dtype = kv_dtype or model.embed_tokens.weight.dtype
        shape = (c.num_layers, num_slots + 1, c.num_kv_heads, c.head_dim)  # + the scratch slot
        self.k_cache = torch.zeros(shape, dtype=self.kv_dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=self.kv_dtype, device=device)
        self.generators: dict[str, torch.Generator] = {}
        cuda_graphs = cuda_graphs and os.environ.get("MINAKV_CUDA_GRAPHS", "1") != "0"
        self.graphs = (
            DecodeGraphs(model, self.k_cache, self.v_cache, pad_slot=num_slots)
            if cuda_graphs and device.type == "cuda"
            else None
        )

    @torch.inference_mode()
    def step(self, batch: ForwardBatch) -> StepResult:
        for rid in batch.release_ids:
            self.generators.pop(rid, None)
        src, dst, old, new = batch.rerotate
        if src:
            moves = torch.tensor([src, dst, old, new], dtype=torch.int64).to(self.device)
            rerotate_copy(self.k_cache, self.v_cache, *moves, self.model.rope)
        if not batch.num_tokens:
            return StepResult([], [])
        logits = None
        if self.graphs is not None and self.graphs.accepts(batch):
            logits = self.graphs.run(batch)
        if logits is None:
            ids = torch.tensor(batch.input_ids, dtype=torch.int64).to(self.device, non_blocking=True)
            hidden = self.model(ids, PagedContext(batch, self.k_cache, self.v_cache))
            if not batch.sample_rows:
                return StepResult([], [])
            rows = torch.tensor(batch.sample_rows, dtype=torch.int64).to(self.device, non_blocking=True)
            logits = self.model.compute_logits(hidden[rows])
        elif batch.sample_rows != list(range(batch.num_decode)):
            logits = logits[torch.tensor(batch.sample_rows, dtype=torch.int64).to(self.device)]
        if all(p.temperature == 0 for p in batch.sample_params):
            return greedy(logits, batch.sample_params)
        gens = [self._generator(rid, p.seed) for rid, p in zip(batch.sample_ids, batch.sample_params)]
        tokens, logprobs = sample(logits, batch.sample_params, gens)
        return StepResult(tokens, logprobs)

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        if request_id not in self.generators:
            self.generators[request_id] = torch.Generator().manual_seed(seed)
        return self.generators[request_id]


def greedy(logits: torch.Tensor, params: list[SamplingParams]) -> StepResult:
    """All rows greedy: the argmax of each row (as `sample` picks it) with one read-back to the host, plus
    the same logprob records as `sample` when asked for."""
    tokens_dev = logits.argmax(dim=-1)
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    if not wanted:
        return StepResult(tokens_dev.tolist(), [None] * len(params))
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, tokens_dev[:, None])[:, 0]
    top_n = max(wanted)
    top_values, top_ids = (
        torch.topk(lp, top_n, dim=-1) if top_n > 0 else (lp[:, :0], tokens_dev[:, None][:, :0])
    )
    tokens, chosen, top_values, top_ids = (t.tolist() for t in (tokens_dev, chosen, top_values, top_ids))
    records: list[TokenLogprob | None] = []
    for row, p in enumerate(params):
        if p.logprobs is None:
            records.append(None)
            continue
        top = list(zip(top_ids[row][: p.logprobs], top_values[row][: p.logprobs]))
        records.append(TokenLogprob(tokens[row], chosen[row], top))
    return StepResult(tokens, records)
