"""Run many segments in ONE forward pass, with dense masked attention (the torch reference).

A forward batch is the concatenation of the queries of several segments (of one or many sequences). The
model runs once over all of them (so the MoE runs once over every token); only attention is per segment:
query i of a segment sees the segment's keys at the segment's key positions plus its own causal prefix,
windows and sinks applied by position (docs/design.md 3.3):

    batch rows:  | seg 0 queries | seg 1 queries | seg 2 queries |
    seg 1 keys:  earlier tokens, either computed in this same pass (any row, at any position: raw K is
                 rotated here) or read from `stored` KV (rotated at a stored position: re-rotated here)

Within one layer every row's K/V is computed before attention, so a segment may read keys produced by an
earlier segment of the same pass: that is what lets a restore recompute a whole dependency closure at once.
The engine's paged worker takes the same metadata (token indices become slots, segments come from
minakv/cache/plan.py); `segments(program, a, b)` cuts a chunk of queries straight from the program.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise

import numpy as np
import torch

from minakv.cache.program import Program
from minakv.model.context import AttentionLayer
from minakv.ops.attention import masked_attention, position_mask
from minakv.ops.rope import apply_rope, rerotate


@dataclass(frozen=True)
class Segment:
    """Queries that see the same earlier keys at the same positions (docs/design.md 3.3).

    Query i of the segment sees `keys` at `key_positions`, plus `queries[: i + 1]` at their
    `query_positions` (its own causal prefix). Keys come before the queries and, like every active token,
    sit at increasing positions in logical order; windows and sinks are applied by attention, by position.
    """

    queries: np.ndarray  # int64 token indices, consecutive
    query_positions: np.ndarray  # int64
    keys: np.ndarray  # int64 token indices < queries[0], increasing
    key_positions: np.ndarray  # int64, increasing


def segments(program: Program, a: int, b: int) -> list[Segment]:
    """Cut the queries [a, b) (a chunk; may run past the prompt into generated tokens) into segments:
    visibility changes only at drop and reposition points."""
    points = {*program.drop_ranges, *program.stage_starts[1:].tolist()}
    bounds = [a, *sorted(p for p in points if a < p < b), b] if a < b else []
    out = []
    for s, e in pairwise(bounds):
        keys, key_pos = program.active_before(s)
        queries = np.arange(s, e, dtype=np.int64)
        out.append(Segment(queries, program.birth_positions(queries), keys, key_pos))
    return out


@dataclass
class StoredKV:
    """KV computed earlier, for some tokens of one sequence: per layer K rotated at `positions`, and V.

    Row r holds token `tokens[r]`, its key rotated at `positions[r]` (like a slot of the paged pool, whose
    position travels beside it)."""

    tokens: np.ndarray  # int64 [S]
    positions: np.ndarray  # int64 [S]
    k: dict[int, torch.Tensor]  # layer -> [S, Hkv, D]
    v: dict[int, torch.Tensor]

    @cached_property
    def row_of(self) -> dict[int, int]:
        return {int(t): r for r, t in enumerate(self.tokens)}

    def rows(self, tokens: np.ndarray) -> np.ndarray:
        index = self.row_of
        missing = [int(t) for t in tokens if int(t) not in index]
        if missing:
            raise KeyError(f"tokens {missing} are neither stored nor computed in this pass")
        return np.asarray([index[int(t)] for t in tokens], dtype=np.int64)


class SegmentContext:
    """An AttentionContext for one forward over `segments` (rows in order: each segment's queries).

    `seq_ids[j]` names the sequence of segment j (default: all one sequence); `stored[seq]` is that
    sequence's earlier KV. After the forward, `k[layer]` / `v[layer]` hold every row's raw (un-rotated)
    K and V, and `to_stored(positions)` turns them into StoredKV for the next pass.
    """

    def __init__(
        self,
        segments: Sequence[Segment],
        stored: dict[int, StoredKV] | StoredKV | None = None,
        seq_ids: Sequence[int] | None = None,
    ) -> None:
        self.segments = list(segments)
        self.seq_ids = list(seq_ids) if seq_ids is not None else [0] * len(self.segments)
        self.stored = {0: stored} if isinstance(stored, StoredKV) else dict(stored or {})
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        # Rows of the batch: which (sequence, token) each one is.
        self.starts = np.cumsum([0] + [len(s.queries) for s in self.segments])
        self.row_of: dict[tuple[int, int], int] = {}
        for seq, seg, start in zip(self.seq_ids, self.segments, self.starts):
            for r, t in enumerate(seg.queries.tolist()):
                self.row_of[(seq, t)] = int(start) + r

    @property
    def num_rows(self) -> int:
        return int(self.starts[-1])

    def tokens(self, seq: int = 0) -> np.ndarray:
        """The token indices of sequence `seq` computed in this pass, in row order."""
        return np.concatenate(
            [s.queries for s, q in zip(self.segments, self.seq_ids) if q == seq] or [np.zeros(0, np.int64)]
        )

    def attend(
        self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if q.shape[0] != self.num_rows:
            raise ValueError(f"the forward has {q.shape[0]} tokens, the segments {self.num_rows} queries")
        self.k[layer.index], self.v[layer.index] = k, v
        out = torch.empty_like(q)
        for seq, seg, start in zip(self.seq_ids, self.segments, self.starts):
            rows = slice(int(start), int(start) + len(seg.queries))
            q_pos = torch.as_tensor(seg.query_positions, device=q.device)
            keys, values = self._keys(layer, seq, seg, k, v)
            own_k = apply_rope(k[rows], *layer.rope.cos_sin(q_pos))
            all_k, all_v = torch.cat([keys, own_k]), torch.cat([values, v[rows]])
            k_pos = torch.cat([torch.as_tensor(seg.key_positions, device=q.device), q_pos])
            mask = position_mask(q_pos, k_pos, layer.window)  # positions increase: causal by position
            q_rot = apply_rope(q[rows], *layer.rope.cos_sin(q_pos))
            out[rows] = masked_attention(q_rot, all_k, all_v, mask, layer.scale, layer.sinks)
        return out

    def _keys(
        self, layer: AttentionLayer, seq: int, seg: Segment, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The segment's earlier keys rotated at its key positions, and their values."""
        n = len(seg.keys)
        keys = k.new_empty((n, *k.shape[1:]))
        values = v.new_empty((n, *v.shape[1:]))
        here = np.asarray([(seq, int(t)) in self.row_of for t in seg.keys], dtype=bool)
        if here.any():  # computed in this pass: rotate the raw key
            idx = torch.as_tensor([self.row_of[(seq, int(t))] for t in seg.keys[here]], device=k.device)
            pos = torch.as_tensor(seg.key_positions[here], device=k.device)
            keys[torch.as_tensor(here)] = apply_rope(k[idx], *layer.rope.cos_sin(pos))
            values[torch.as_tensor(here)] = v[idx]
        if (~here).any():  # stored: re-rotate from the stored position to this segment's position
            store = self.stored.get(seq)
            if store is None:
                raise KeyError(f"segment of sequence {seq} reads stored KV, but none was given")
            rows = torch.as_tensor(store.rows(seg.keys[~here]), device=k.device)
            old = torch.as_tensor(store.positions[rows.cpu().numpy()], device=k.device)
            new = torch.as_tensor(seg.key_positions[~here], device=k.device)
            stored_k = store.k[layer.index][rows].to(k.dtype)
            keys[torch.as_tensor(~here)] = rerotate(
                stored_k, layer.rope.cos_sin(old), layer.rope.cos_sin(new)
            )
            values[torch.as_tensor(~here)] = store.v[layer.index][rows].to(v.dtype)
        return keys, values

    def to_stored(self, layers: Sequence[AttentionLayer], positions: np.ndarray, seq: int = 0) -> StoredKV:
        """This pass's KV of sequence `seq` as StoredKV, keys rotated at `positions` (one per token of
        `tokens(seq)`)."""
        tokens = self.tokens(seq)
        rows = torch.as_tensor([self.row_of[(seq, int(t))] for t in tokens], dtype=torch.long)
        pos = torch.as_tensor(np.asarray(positions, dtype=np.int64))
        k = {layer.index: apply_rope(self.k[layer.index][rows], *layer.rope.cos_sin(pos)) for layer in layers}
        v = {layer.index: self.v[layer.index][rows] for layer in layers}
        return StoredKV(tokens, np.asarray(positions, dtype=np.int64), k, v)
