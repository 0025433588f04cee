"""One forward step as data: the flat token batch and the attention metadata over the paged KV.

`ForwardBatch` is the contract between the scheduler and the worker. The batch holds decode queries first
(one token per request), then prefill/restore segments. Every query reads a list of (slot, position) keys:
for a decode query, the request's active keys including its own; for a segment, the keys active where the
segment starts, plus (implicitly) the segment's own causal prefix. Segments are what make drop and restore
exact: a segment ends wherever the set of visible keys changes (docs/design.md 3.3).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import torch

from minakv.params import SamplingParams


@dataclass
class ForwardBatch:
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # position each token is born at
    slots: list[int] = field(default_factory=list)  # where each token's K/V is stored
    num_decode: int = 0  # the first num_decode tokens are decode queries
    seg_q_indptr: list[int] = field(default_factory=lambda: [0])  # segments over the prefill tokens
    kv_indptr: list[int] = field(default_factory=lambda: [0])  # per decode query, then per segment
    kv_slots: list[int] = field(default_factory=list)
    kv_pos: list[int] = field(default_factory=list)
    # re-rotation copies to make before the forward (all layers): src slot -> dst slot, old -> new position
    rerotate: tuple[list[int], list[int], list[int], list[int]] = field(
        default_factory=lambda: ([], [], [], [])
    )
    # sampling: which token rows produce a next token, for which request, with which parameters
    sample_rows: list[int] = field(default_factory=list)
    sample_ids: list[str] = field(default_factory=list)
    sample_params: list[SamplingParams] = field(default_factory=list)
    release_ids: list[str] = field(default_factory=list)  # finished requests: drop their sampler state
    # the scheduler's own note, which the worker never reads: (request, cursor after the step, samples?)
    scheduled: list[tuple[Any, int, bool]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def add_keys(self, slots: list[int], positions: list[int]) -> None:
        """Close one query group (decode query or segment) with its keys' slots and positions."""
        self.kv_slots += slots
        self.kv_pos += positions
        self.kv_indptr.append(len(self.kv_slots))


def host_int64(lists: list[list[int]], pin: bool) -> torch.Tensor:
    """The concatenated int lists as one int64 CPU tensor (pinned for an asynchronous copy to a GPU).
    numpy's fromiter is ~4x faster than torch.tensor on a Python list, which matters at 10k keys a step."""
    flat = torch.from_numpy(np.fromiter(chain(*lists), dtype=np.int64, count=sum(map(len, lists))))
    return flat.pin_memory() if pin else flat
