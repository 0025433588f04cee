"""CUDA graphs for decode steps: one captured forward per batch bucket.

A decode step of a large MoE model is thousands of small kernels; launching them one by one from Python
costs more than running them. So a step whose tokens are all decode queries replays a graph captured
once for a padded shape:

- the batch is padded up to a bucket (1, 2, 4, 8, then multiples of 16); padding rows read no keys, sit at
  position 0 and write their K/V into a scratch slot past the end of the pool, which no request owns;
- nothing in a graph depends on how many keys the requests read: decode attention cuts each request's own
  keys into a number of chunks fixed by the batch bucket (`per_row_splits`, minakv/ops/decode_attention.py),
  so a graph serves its batch bucket at any history length, and a run whose histories grow captures
  nothing new;
- a step with no graph of its own replays one captured for up to twice its batch bucket if there is one,
  rather than capture (`_covering`).

The keys themselves live in the worker's key table (a static device tensor the graph reads). The graph's
other inputs live in one static int64 buffer per graph, `[ids | positions | slots | kv_start | kv_end]`
(B each), refreshed with one host-to-device copy per step: the bytes sent never depend on the history.
The output is the float32 logits of the padded batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minakv.model import CausalLM
from minakv.ops.decode_attention import default_splits
from minakv.worker.batch import ForwardBatch, host_int64
from minakv.worker.paged import KeyTable, PagedContext


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    buffer: torch.Tensor  # the static inputs, see the module docstring
    logits: torch.Tensor  # [B, V] float32, written by each replay
    batch: int


def bucket_batch(n: int) -> int:
    for size in (1, 2, 4, 8):
        if n <= size:
            return size
    return -(-n // 16) * 16


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        table: KeyTable,
        pad_slot: int,
        max_batch: int = 256,
    ) -> None:
        self.model, self.k_cache, self.v_cache, self.table = model, k_cache, v_cache, table
        self.pad_slot, self.max_batch = pad_slot, max_batch
        self.graphs: dict[int, _Graph] = {}  # by batch bucket
        self.pool = None  # one memory pool shared by all graphs (they never run at the same time)
        self.enabled = True
        self.failure: str | None = None  # why capture failed (then every step runs eagerly)

    def accepts(self, batch: ForwardBatch) -> bool:
        return self.enabled and 0 < batch.num_decode == batch.num_tokens <= self.max_batch

    def run(self, batch: ForwardBatch, resolve) -> torch.Tensor | None:
        """Logits [num_decode, V] of a decode-only batch, or None if no graph could be captured.
        `resolve(ids)` replaces the ids still on the device (negative) by the previous step's tokens."""
        n = batch.num_decode
        g = self.find(n)
        if g is None:
            g = self._capture(bucket_batch(n))
            if g is None:
                return None
        pad, width = g.batch - n, self.table.width
        starts = [row * width for row in batch.decode_rows]
        ends = [s + length for s, length in zip(starts, batch.decode_lens)]
        host = host_int64([
            batch.input_ids, [0] * pad, batch.positions, [0] * pad, batch.slots, [self.pad_slot] * pad,
            starts, [0] * pad, ends, [0] * pad,
        ], pin=True)  # fmt: skip
        g.buffer.copy_(host, non_blocking=True)
        ids = g.buffer[:n]
        ids.copy_(resolve(ids))
        g.graph.replay()
        return g.logits[:n]

    def find(self, n: int) -> _Graph | None:
        """The captured graph a decode step of n rows replays, if any."""
        b = bucket_batch(n)
        return self.graphs.get(b) or self._covering(b)

    def _covering(self, b: int) -> _Graph | None:
        """A captured graph that can serve batch bucket b at little extra cost: at most twice the batch (a
        decode step reads the weights once whatever the batch). Capturing runs the model eagerly three
        times (~0.1 s with the device idle), which a step that a graph already covers need not wait for:
        agents finishing a round one by one step through batch sizes no round had before."""
        fits = [key for key in self.graphs if b <= key <= 2 * b]
        return self.graphs[min(fits)] if fits else None

    def _forward(self, buffer: torch.Tensor, b: int) -> torch.Tensor:
        ids, positions, slots, kv_start, kv_end = buffer.split(b)
        splits = default_splits(b, self.k_cache.shape[2], self.k_cache.device)
        ctx = PagedContext.decode_only(
            self.k_cache, self.v_cache, positions, slots, kv_start, kv_end, self.table, splits
        )  # a fresh context per forward: its cos/sin table is computed inside the captured region
        return self.model.compute_logits(self.model(ids, ctx))

    def _capture(self, b: int) -> _Graph | None:
        device = self.k_cache.device
        buffer = torch.zeros(5 * b, dtype=torch.int64, device=device)
        buffer[2 * b : 3 * b].fill_(self.pad_slot)  # warm-up and capture write K/V only into the scratch slot
        try:
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream), torch.inference_mode():
                for _ in range(2):  # compile kernels and settle allocations outside the capture
                    self._forward(buffer, b)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the engine steps in its own thread; other threads may use CUDA meanwhile
            with (
                torch.inference_mode(),
                torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"),
            ):
                logits = self._forward(buffer, b)
        except Exception as exc:  # noqa: BLE001 (a host sync or an uncapturable op in the model: run eagerly)
            self.enabled, self.failure = False, f"{type(exc).__name__}: {exc}"
            torch.cuda.synchronize(device)
            return None
        self.pool = graph.pool()
        g = _Graph(graph, buffer, logits, b)
        self.graphs[b] = g
        return g
