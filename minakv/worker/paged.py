"""The attention context of a paged forward step: what the model's attention layers see.

It rotates q/k at the tokens' positions, stores K/V into their slots, then runs decode attention (each
decode query over its row of the key table) and segment attention (each segment over the keys sent with
the batch, plus its own causal prefix), Triton on CUDA and torch references elsewhere. The metadata is
copied to the device once per step and shared by all layers.
"""

from __future__ import annotations

from itertools import pairwise

import torch

from minakv.model.context import AttentionLayer
from minakv.ops.decode_attention import decode_attention
from minakv.ops.kv_store import rotate_and_store
from minakv.ops.segment_attention import plan_segments, segment_attention
from minakv.ops.triton_util import use_triton
from minakv.worker.batch import ForwardBatch, flatten, host_int64


class KeyTable:
    """Per running request, the (slot, position) of every key its next decode token reads, on the device.

    Row r, columns [0, len): a request's keys in order. Decode attention reads row r as the flat range
    [r * width, r * width + len) of `slots` and `positions`."""

    def __init__(self, rows: int, width: int, device: torch.device) -> None:
        self.width = width
        self.slots = torch.zeros(rows * width, dtype=torch.int32, device=device)
        self.positions = torch.zeros(rows * width, dtype=torch.int32, device=device)

    def write(self, flat: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> None:
        self.slots[flat] = slots.to(torch.int32)
        self.positions[flat] = positions.to(torch.int32)


class PagedContext:
    def __init__(self, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor, table: KeyTable):
        device = k_cache.device
        b = batch.num_decode
        starts = [row * table.width for row in batch.decode_rows]
        ends = [s + n for s, n in zip(starts, batch.decode_lens)]
        # all index lists in one host tensor and one copy: on CUDA a pinned, asynchronous transfer
        columns = [[batch.positions], [batch.slots], [starts], [ends], [batch.seg_q_indptr],
                   [batch.seg_kv_indptr], batch.seg_kv_slots, batch.seg_kv_pos]  # fmt: skip
        chunks, sizes = flatten(columns)
        parts = host_int64(chunks, pin=device.type == "cuda").to(device, non_blocking=True).split(sizes)
        positions, slots, kv_start, kv_end, seg_q_indptr, seg_kv_indptr, seg_kv_slots, seg_kv_pos = parts
        self.k_cache, self.v_cache = k_cache, v_cache
        self.positions, self.slots, self.num_decode = positions, slots, b
        self.decode = (kv_start, kv_end, table.slots, table.positions)
        self.max_kv_len = max(batch.decode_lens, default=0)  # host-side sizes: no read-back in the kernels
        self.splits: int | None = None  # (CUDA graphs: chunks per request's keys, see decode_only)
        self.segments = (seg_q_indptr, seg_kv_indptr, seg_kv_slots, seg_kv_pos)
        self.max_seg_len = max((y - x for x, y in pairwise(batch.seg_q_indptr)), default=0)
        self._cos_sin: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._plan = None  # the segment kernel's plan, built on first use and shared by all layers

    @classmethod
    def decode_only(
        cls,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        kv_start: torch.Tensor,
        kv_end: torch.Tensor,
        table: KeyTable,
        splits: int,
    ) -> PagedContext:
        """A context of decode queries only, over device tensors the caller owns (the static buffers of
        a CUDA graph, minakv/worker/graphs.py). No key count is known: decode attention cuts each request's
        own keys into `splits` chunks."""
        self = cls.__new__(cls)
        self.k_cache, self.v_cache = k_cache, v_cache
        self.positions, self.slots, self.num_decode = positions, slots, positions.shape[0]
        self.decode = (kv_start, kv_end, table.slots, table.positions)
        self.max_kv_len, self.splits = 0, splits
        self.segments, self.max_seg_len = None, 0
        self._cos_sin, self._plan = {}, None
        return self

    def attend(
        self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        key = id(layer.rope)
        if key not in self._cos_sin:  # one table per forward, shared by all layers
            self._cos_sin[key] = layer.rope.cos_sin(self.positions)
        cos, sin = self._cos_sin[key]
        k_cache, v_cache = self.k_cache[layer.index], self.v_cache[layer.index]
        q = rotate_and_store(q, k, v, cos, sin, self.slots, k_cache, v_cache)
        b = self.num_decode
        decode = segments = None
        if b:
            kv_start, kv_end, kv_slots, kv_pos = self.decode
            decode = decode_attention(
                q[:b],
                k_cache,
                v_cache,
                kv_start,
                kv_slots,
                kv_pos,
                self.positions[:b],
                layer.scale,
                layer.window,
                layer.sinks,
                max_kv_len=self.max_kv_len + 1,
                kv_end=kv_end,
                ascending=True,
                per_row_splits=self.splits,
            )  # fmt: skip  (a row's keys sit at increasing positions: active tokens in logical order)
        if q.shape[0] > b:
            seg_q_indptr, seg_kv_indptr, kv_slots, kv_pos = self.segments
            q_pos, q_slots = self.positions[b:], self.slots[b:]
            if self._plan is None and use_triton(q):
                self._plan = plan_segments(
                    q_pos, q_slots, seg_q_indptr, seg_kv_indptr, kv_slots, kv_pos, self.max_seg_len
                )
            segments = segment_attention(
                q[b:], k_cache, v_cache, q_pos, q_slots, seg_q_indptr, seg_kv_indptr, kv_slots, kv_pos,
                layer.scale, layer.window, layer.sinks, max_seg_len=self.max_seg_len, plan=self._plan,
            )  # fmt: skip
        if segments is None:
            return decode
        return segments if decode is None else torch.cat([decode, segments])
