"""CUDA graphs for decode steps: one captured forward per (batch bucket, key-count bucket).

A decode step of a large MoE model is thousands of small kernels; launching them one by one from Python
costs more than running them. So a step whose tokens are all decode queries replays a graph captured
once for a padded shape:

- the batch is padded up to a bucket (1, 2, 4, 8, then multiples of 16); padding rows read no keys, sit at
  position 0 and write their K/V into a scratch slot past the end of the pool, which no request owns;
- the decode kernel's split of the key range is frozen at capture, so a graph is captured for a bound on
  every request's key count (a power of two, >= 256) and serves all steps under that bound (the kernel
  reads the real ranges from the key-list pointers, so fewer keys are fine).

The graph's inputs live in one static int64 buffer per graph, laid out as
`[ids | positions | slots | kv_indptr (B + 1) | kv_slots (capacity) | kv_pos (capacity)]`, and are refreshed
with two host-to-device copies per step. The output is the float32 logits of the padded batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch

from minakv.model import CausalLM
from minakv.worker.batch import ForwardBatch, host_int64
from minakv.worker.paged import PagedContext

MIN_KEY_BUCKET = 256


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    buffer: torch.Tensor  # the static inputs, see the module docstring
    logits: torch.Tensor  # [B, V] float32, written by each replay
    batch: int
    capacity: int  # room for key entries: batch * key bound


def bucket_batch(n: int) -> int:
    for size in (1, 2, 4, 8):
        if n <= size:
            return size
    return -(-n // 16) * 16


def bucket_keys(n: int) -> int:
    return max(MIN_KEY_BUCKET, 1 << max(0, n - 1).bit_length())


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        pad_slot: int,
        max_batch: int = 64,
    ) -> None:
        self.model, self.k_cache, self.v_cache = model, k_cache, v_cache
        self.pad_slot, self.max_batch = pad_slot, max_batch
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = None  # one memory pool shared by all graphs (they never run at the same time)
        self.enabled = True
        self.failure: str | None = None  # why capture failed (then every step runs eagerly)

    def accepts(self, batch: ForwardBatch) -> bool:
        return self.enabled and 0 < batch.num_decode == batch.num_tokens <= self.max_batch

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits [num_decode, V] of a decode-only batch, or None if no graph could be captured."""
        n = batch.num_decode
        indptr = batch.kv_indptr
        longest = max(b - a for a, b in pairwise(indptr))
        key = (bucket_batch(n), bucket_keys(longest))
        g = self.graphs.get(key)
        if g is None:
            g = self._capture(*key)
            if g is None:
                return None
        self._fill(g, batch)
        g.graph.replay()
        return g.logits[:n]

    def _fill(self, g: _Graph, batch: ForwardBatch) -> None:
        n, b = batch.num_decode, g.batch
        pad = b - n
        total = batch.kv_indptr[n]
        host = host_int64([
            batch.input_ids, [0] * pad, batch.positions, [0] * pad, batch.slots, [self.pad_slot] * pad,
            batch.kv_indptr, [total] * pad, batch.kv_slots, batch.kv_pos,
        ], pin=True)  # fmt: skip
        start = 4 * b + 1 + total  # ids .. kv_slots are contiguous; kv_pos starts after the slot capacity
        g.buffer[:start].copy_(host[:start], non_blocking=True)
        at = 4 * b + 1 + g.capacity
        g.buffer[at : at + total].copy_(host[start:], non_blocking=True)

    def _views(self, buffer: torch.Tensor, b: int, capacity: int) -> list[torch.Tensor]:
        sizes = [b, b, b, b + 1, capacity, capacity]
        return list(buffer.split(sizes))

    def _forward(self, views: list[torch.Tensor], max_keys: int) -> torch.Tensor:
        ids, positions, slots, kv_indptr, kv_slots, kv_pos = views
        ctx = PagedContext.decode_only(
            self.k_cache, self.v_cache, positions, slots, kv_indptr, kv_slots, kv_pos, max_keys
        )  # a fresh context per forward: its cos/sin table is computed inside the captured region
        return self.model.compute_logits(self.model(ids, ctx))

    def _capture(self, b: int, max_keys: int) -> _Graph | None:
        capacity = b * max_keys
        device = self.k_cache.device
        buffer = torch.zeros(4 * b + 1 + 2 * capacity, dtype=torch.int64, device=device)
        views = self._views(buffer, b, capacity)
        views[2].fill_(self.pad_slot)  # warm-up and capture write K/V only into the scratch slot
        try:
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream), torch.inference_mode():
                for _ in range(2):  # compile kernels and settle allocations outside the capture
                    self._forward(views, max_keys)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the engine steps in its own thread; other threads may use CUDA meanwhile
            with (
                torch.inference_mode(),
                torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"),
            ):
                logits = self._forward(views, max_keys)
        except Exception as exc:  # noqa: BLE001 (a host sync or an uncapturable op in the model: run eagerly)
            self.enabled, self.failure = False, f"{type(exc).__name__}: {exc}"
            torch.cuda.synchronize(device)
            return None
        self.pool = graph.pool()
        g = _Graph(graph, buffer, logits, b, capacity)
        self.graphs[(b, max_keys)] = g
        return g
