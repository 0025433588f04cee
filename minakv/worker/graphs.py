"""CUDA graphs for decode steps: one captured forward per (batch bucket, key-count bucket).

A decode step of a large MoE model is thousands of small kernels; launching them one by one from Python
costs more than running them. So a step whose tokens are all decode queries replays a graph captured
once for a padded shape:

- the batch is padded up to a bucket (1, 2, 4, 8, then multiples of 16); padding rows read no keys, sit at
  position 0 and write their K/V into a scratch slot past the end of the pool, which no request owns;
- the decode kernel's split of the key range is frozen at capture, so a graph is captured for a bound on
  every request's key count (a power of two, >= 256) and serves all steps under that bound (the kernel
  reads the real ranges from the start/end pointers, so fewer keys are fine);
- a step with no graph of its own replays one captured for up to twice its batch bucket and four times
  its key bound if there is one, rather than capture (`_covering`).

The keys themselves live in the worker's key table (a static device tensor the graph reads). The graph's
other inputs live in one static int64 buffer per graph, `[ids | positions | slots | kv_start | kv_end]`
(B each), refreshed with one host-to-device copy per step: the bytes sent never depend on the history.
The output is the float32 logits of the padded batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minakv.model import CausalLM
from minakv.worker.batch import ForwardBatch, host_int64
from minakv.worker.paged import KeyTable, PagedContext

MIN_KEY_BUCKET = 256


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


def bucket_keys(n: int) -> int:
    return max(MIN_KEY_BUCKET, 1 << max(0, n - 1).bit_length())


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
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = None  # one memory pool shared by all graphs (they never run at the same time)
        self.enabled = True
        self.failure: str | None = None  # why capture failed (then every step runs eagerly)

    def accepts(self, batch: ForwardBatch) -> bool:
        return self.enabled and 0 < batch.num_decode == batch.num_tokens <= self.max_batch

    def run(self, batch: ForwardBatch, resolve) -> torch.Tensor | None:
        """Logits [num_decode, V] of a decode-only batch, or None if no graph could be captured.
        `resolve(ids)` replaces the ids still on the device (negative) by the previous step's tokens."""
        n = batch.num_decode
        g = self.find(n, max(batch.decode_lens) + 1)
        if g is None:
            g = self._capture(bucket_batch(n), bucket_keys(max(batch.decode_lens) + 1))
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

    def find(self, n: int, keys: int) -> _Graph | None:
        """The captured graph a decode step of n rows with up to `keys` keys each replays, if any."""
        key = (bucket_batch(n), bucket_keys(keys))
        return self.graphs.get(key) or self._covering(*key)

    def _covering(self, b: int, max_keys: int) -> _Graph | None:
        """A captured graph that can serve (b, max_keys) at little extra cost: at most twice the batch and
        four times the key bound (a decode step reads the weights once whatever the batch, and splits past
        the real keys return at once). Capturing runs the model eagerly three times (~0.1 s with the
        device idle), which a step that a graph already covers need not wait for: agents finishing a
        round one by one step through batch sizes no round had before."""
        fits = [key for key in self.graphs if b <= key[0] <= 2 * b and max_keys <= key[1] <= 4 * max_keys]
        return self.graphs[min(fits)] if fits else None

    def _forward(self, buffer: torch.Tensor, b: int, max_keys: int) -> torch.Tensor:
        ids, positions, slots, kv_start, kv_end = buffer.split(b)
        ctx = PagedContext.decode_only(
            self.k_cache, self.v_cache, positions, slots, kv_start, kv_end, self.table, max_keys
        )  # a fresh context per forward: its cos/sin table is computed inside the captured region
        return self.model.compute_logits(self.model(ids, ctx))

    def _capture(self, b: int, max_keys: int) -> _Graph | None:
        device = self.k_cache.device
        buffer = torch.zeros(5 * b, dtype=torch.int64, device=device)
        buffer[2 * b : 3 * b].fill_(self.pad_slot)  # warm-up and capture write K/V only into the scratch slot
        try:
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream), torch.inference_mode():
                for _ in range(2):  # compile kernels and settle allocations outside the capture
                    self._forward(buffer, b, max_keys)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the engine steps in its own thread; other threads may use CUDA meanwhile
            with (
                torch.inference_mode(),
                torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"),
            ):
                logits = self._forward(buffer, b, max_keys)
        except Exception as exc:  # noqa: BLE001 (a host sync or an uncapturable op in the model: run eagerly)
            self.enabled, self.failure = False, f"{type(exc).__name__}: {exc}"
            torch.cuda.synchronize(device)
            return None
        self.pool = graph.pool()
        g = _Graph(graph, buffer, logits, b)
        self.graphs[(b, max_keys)] = g
        return g
