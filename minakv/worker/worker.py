"""The worker: owns the model, the KV tensors and the key table, and turns one `ForwardBatch` into tokens.

Its interface is deliberately narrow (a batch in, tokens out) so that prefill and decode workers can later
run in separate processes. It knows nothing of requests: seeds and output counters come with the batch.

A step: apply the batch's key-table writes and re-rotation copies, run the forward (a CUDA graph replay
for decode-only steps on CUDA; the pool has one scratch slot past its end for the graphs' padding rows),
sample every row at once on the device, and read the results back in one transfer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from minakv.model import CausalLM
from minakv.ops.rerotate import rerotate_copy
from minakv.outputs import TokenLogprob
from minakv.params import SamplingParams
from minakv.worker.batch import ForwardBatch, flatten, host_int64
from minakv.worker.graphs import DecodeGraphs
from minakv.worker.paged import KeyTable, PagedContext
from minakv.worker.penalties import PenaltyTables
from minakv.worker.sampler import SamplingTensors, sample_packed, unpack


@dataclass
class Launched:
    """A step on its way: its packed results (on the host once `event` has passed), and how to read them."""

    packed: torch.Tensor | None
    event: torch.cuda.Event | None
    params: list[SamplingParams]
    max_logprobs: int


@dataclass
class StepResult:
    tokens: list[int]  # one per sample row
    logprobs: list[TokenLogprob | None]


def kv_bytes_per_token(model: CausalLM, dtype: torch.dtype) -> int:
    """On this rank: under tensor parallelism it stores only its kv heads (`model.kv_heads`)."""
    c = model.config
    return 2 * c.num_layers * model.kv_heads * c.head_dim * torch.tensor([], dtype=dtype).element_size()


class Worker:
    def __init__(
        self,
        model: CausalLM,
        num_slots: int,
        max_rows: int,
        max_keys: int,
        kv_dtype: torch.dtype | None = None,
        cuda_graphs: bool = True,  # CUDA only; MINAKV_CUDA_GRAPHS=0 also turns them off
    ) -> None:
        """`max_rows`: requests decoding at once; `max_keys`: the most keys one request's token reads."""
        self.model = model
        model.fuse()  # one GEMM for q, k and v, folded MXFP4 scales (before any CUDA graph captures)
        c = model.config
        device = next(model.parameters()).device
        self.device = device
        self.kv_dtype = kv_dtype or model.embed_tokens.weight.dtype
        shape = (c.num_layers, num_slots + 1, model.kv_heads, c.head_dim)  # + the scratch slot; rank's heads
        self.k_cache = torch.zeros(shape, dtype=self.kv_dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=self.kv_dtype, device=device)
        self.table = KeyTable(max_rows, max_keys, device)
        self.max_rows = max_rows
        self.last_tokens = torch.zeros(0, dtype=torch.int64, device=device)  # the previous step's samples
        self.penalties: PenaltyTables | None = None  # made when a request first asks for a penalty
        cuda_graphs = cuda_graphs and os.environ.get("MINAKV_CUDA_GRAPHS", "1") != "0"
        self.graphs = (
            DecodeGraphs(
                model, self.k_cache, self.v_cache, self.table, pad_slot=num_slots, max_batch=max_rows
            )
            if cuda_graphs and device.type == "cuda"
            else None
        )

    def step(self, batch: ForwardBatch) -> StepResult:
        return self.collect(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: ForwardBatch) -> Launched:
        """Enqueue the step's device work (forward, sampling, packing the results) and start copying the
        results to the host; returns at once on CUDA, so the host can prepare the next step meanwhile."""
        self._write_table(batch)
        for row, prompt_ids, output_ids in batch.penalty_resets:
            if self.penalties is None:  # the first penalised request: the tables cost nothing before
                vocab = self.model.config.vocab_size
                self.penalties = PenaltyTables(self.max_rows, vocab, self.device)
            self.penalties.reset(row, prompt_ids, output_ids)
        if batch.num_copies:  # (src slot, dst slot, old position, new position) columns in one copy
            chunks, sizes = flatten(list(batch.rerotate))
            pinned = self.device.type == "cuda"
            moves = host_int64(chunks, pin=pinned).to(self.device, non_blocking=True).split(sizes)
            rerotate_copy(self.k_cache, self.v_cache, *moves, self.model.rope)
        if not batch.sample_rows:
            if batch.num_tokens:
                self._forward(batch)
            return Launched(None, None, [], 0)
        logits = self._forward(batch)
        t = SamplingTensors.build(
            batch.sample_params,
            batch.sample_seeds,
            batch.sample_counters,
            self.device,
            batch.sample_penalty_rows,
            batch.mask_rows,
            batch.token_mask,
        )
        tokens, packed = sample_packed(logits, t, self.penalties)
        self.last_tokens = tokens
        event = None
        if self.device.type == "cuda":
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            packed = host
        return Launched(packed, event, batch.sample_params, t.max_logprobs)

    def collect(self, launched: Launched) -> StepResult:
        """Wait for a launched step's results on the host."""
        if launched.packed is None:
            return StepResult([], [])
        if launched.event is not None:
            launched.event.synchronize()
        tokens, logprobs = unpack(launched.packed.tolist(), launched.params, launched.max_logprobs)
        return StepResult(tokens, logprobs)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [sample rows, V] (hidden states only where nothing is sampled)."""
        if self.graphs is not None and self.graphs.accepts(batch):
            logits = self.graphs.run(batch, self._resolve)
            if logits is not None:
                if batch.sample_rows != list(range(batch.num_decode)):
                    logits = logits[torch.tensor(batch.sample_rows, dtype=torch.int64).to(self.device)]
                return logits
        ids = torch.tensor(batch.input_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        hidden = self.model(self._resolve(ids), PagedContext(batch, self.k_cache, self.v_cache, self.table))
        if not batch.sample_rows:
            return hidden
        rows = torch.tensor(batch.sample_rows, dtype=torch.int64).to(self.device, non_blocking=True)
        return self.model.compute_logits(hidden[rows])

    def _resolve(self, ids: torch.Tensor) -> torch.Tensor:
        """Replace ids still on the device (-(j + 1): row j of the previous step's samples) by those tokens."""
        if not self.last_tokens.numel():
            return ids
        pending = ids < 0
        return torch.where(
            pending, self.last_tokens[(-ids - 1).clamp(min=0, max=self.last_tokens.numel() - 1)], ids
        )

    def _write_table(self, batch: ForwardBatch) -> None:
        if not batch.table_writes[0] and not batch.num_decode:
            return
        writes = [list(c) for c in batch.table_writes]
        if batch.num_decode:
            for column, extra in zip(writes, batch.decode_key_writes()):
                column += extra
        chunks, sizes = flatten(writes)
        host = host_int64(chunks, pin=self.device.type == "cuda")
        r, c, s, p = host.to(self.device, non_blocking=True).split(sizes)
        self.table.write(r * self.table.width + c, s, p)
