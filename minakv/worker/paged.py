"""The attention context of a paged forward step: what the model's attention layers see.

It rotates q/k at the tokens' positions, stores K/V into their slots, then runs decode and segment attention
over the pool (Triton on CUDA, torch references elsewhere). Metadata is copied to the device once per step
and shared by all layers.
"""

from __future__ import annotations

from itertools import pairwise

import torch

from minakv.model.context import AttentionLayer
from minakv.ops.decode_attention import decode_attention
from minakv.ops.kv_store import rotate_and_store
from minakv.ops.segment_attention import plan_segments, segment_attention
from minakv.ops.triton_util import use_triton
from minakv.worker.batch import ForwardBatch, host_int64


class PagedContext:
    def __init__(self, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        device = k_cache.device
        # all index lists in one host tensor and one copy: on CUDA a pinned, asynchronous transfer
        lists = [
            batch.positions,
            batch.slots,
            batch.seg_q_indptr,
            batch.kv_indptr,
            batch.kv_slots,
            batch.kv_pos,
        ]
        flat = host_int64(lists, pin=device.type == "cuda")
        parts = flat.to(device, non_blocking=True).split([len(xs) for xs in lists])
        # host-side sizes, so the kernels need not read them back from the device
        lengths = [b - a for a, b in pairwise(batch.kv_indptr)]
        seg = batch.seg_q_indptr
        self._init(
            k_cache, v_cache, *parts, num_decode=batch.num_decode,
            decode_keys=batch.kv_indptr[batch.num_decode],  # keys of decode queries come first
            max_kv_len=max(lengths[: batch.num_decode], default=0) + 1,
            max_seg_len=max((b - a for a, b in pairwise(seg)), default=0),
        )  # fmt: skip

    @classmethod
    def decode_only(
        cls,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_slots: torch.Tensor,
        kv_pos: torch.Tensor,
        max_kv_len: int,
    ) -> PagedContext:
        """A context of decode queries only, over device tensors the caller owns (the static buffers of
        a CUDA graph, minakv/worker/graphs.py); `max_kv_len` bounds every request's key count."""
        self = cls.__new__(cls)
        empty = torch.zeros(1, dtype=torch.int64, device=k_cache.device)
        self._init(
            k_cache, v_cache, positions, slots, empty, kv_indptr, kv_slots, kv_pos,
            num_decode=positions.shape[0], decode_keys=0, max_kv_len=max_kv_len, max_seg_len=0,
        )  # fmt: skip
        return self

    def _init(
        self, k_cache, v_cache, positions, slots, seg_q_indptr, kv_indptr, kv_slots, kv_pos, *,
        num_decode: int, decode_keys: int, max_kv_len: int, max_seg_len: int,
    ) -> None:  # fmt: skip
        self.k_cache, self.v_cache = k_cache, v_cache
        self.positions, self.slots, self.num_decode = positions, slots, num_decode
        self.seg_q_indptr, self.kv_indptr, self.kv_slots, self.kv_pos = (
            seg_q_indptr,
            kv_indptr,
            kv_slots,
            kv_pos,
        )
        self.decode_keys, self.max_kv_len, self.max_seg_len = decode_keys, max_kv_len, max_seg_len
        self._cos_sin: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._segments = None  # (segment metadata, kernel plan), built on first use and shared by all layers

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
            decode = decode_attention(
                q[:b], k_cache, v_cache, self.kv_indptr[: b + 1], self.kv_slots, self.kv_pos,
                self.positions[:b], layer.scale, layer.window, layer.sinks, max_kv_len=self.max_kv_len,
            )  # fmt: skip
        if q.shape[0] > b:
            if self._segments is None:
                self._segments = self._segment_metadata(q)
            (q_pos, q_slots, seg_kv_indptr, kv_slots, kv_pos), plan = self._segments
            segments = segment_attention(
                q[b:], k_cache, v_cache, q_pos, q_slots, self.seg_q_indptr, seg_kv_indptr, kv_slots, kv_pos,
                layer.scale, layer.window, layer.sinks, max_seg_len=self.max_seg_len, plan=plan,
            )  # fmt: skip
        if segments is None:
            return decode
        return segments if decode is None else torch.cat([decode, segments])

    def _segment_metadata(self, q: torch.Tensor):
        """The segments' tensors (their key lists follow the decode queries' keys) and, for the Triton
        kernel, its per-forward plan: built once, shared by all layers."""
        b, n = self.num_decode, self.decode_keys
        meta = (
            self.positions[b:],
            self.slots[b:],
            self.kv_indptr[b:] - n,
            self.kv_slots[n:],
            self.kv_pos[n:],
        )
        plan = (
            plan_segments(*meta[:2], self.seg_q_indptr, *meta[2:], self.max_seg_len)
            if use_triton(q)
            else None
        )
        return meta, plan
