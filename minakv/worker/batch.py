"""One forward step as data: the flat token batch and the attention metadata over the paged KV.

`ForwardBatch` is the contract between the scheduler and the worker. The batch holds decode queries first
(one token per request), then prefill/restore segments:

- a decode query reads its request's active keys from the worker's *key table*: one row per running
  request, holding the (slot, position) of every key that request's next token reads. The table lives on
  the device and grows by appending: each step writes only the new entries, so the bytes sent per step do
  not grow with the history. A query's own key needs no write of its own: it goes to column
  `decode_lens[i] - 1` of `decode_rows[i]`, with the query's slot and position (`decode_key_writes`);
  `table_writes` holds the rest: a whole row, the first time a request decodes.
- a segment reads the keys active where it starts (sent with the batch), plus its own causal prefix.
  Segments are what make drop and restore exact: a segment ends wherever the set of visible keys changes
  (docs/design.md 3.3).

An input id may still be on the device: `-(j + 1)` stands for the token sampled at row j of the previous
step (the overlap loop schedules step N + 1 before step N's tokens reach the host).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import torch

from minakv.params import SamplingParams

IntList = list[int] | np.ndarray


@dataclass
class ForwardBatch:
    input_ids: list[int] = field(default_factory=list)  # negative: a token still on the device (above)
    positions: list[int] = field(default_factory=list)  # position each token is born at
    slots: list[int] = field(default_factory=list)  # where each token's K/V is stored
    num_decode: int = 0  # the first num_decode tokens are decode queries
    # decode queries: their key-table rows and the number of keys each row holds after this step's writes
    decode_rows: list[int] = field(default_factory=list)
    decode_lens: list[int] = field(default_factory=list)
    # key-table writes before the forward: (row, column, slot, position) columns, chunks of lists or arrays
    table_writes: tuple[list[IntList], list[IntList], list[IntList], list[IntList]] = field(
        default_factory=lambda: ([], [], [], [])
    )
    # segments over the prefill tokens, and the keys each sees from before it
    seg_q_indptr: list[int] = field(default_factory=lambda: [0])
    seg_kv_indptr: list[int] = field(default_factory=lambda: [0])
    seg_kv_slots: list[IntList] = field(default_factory=list)  # chunks, one per segment piece
    seg_kv_pos: list[IntList] = field(default_factory=list)
    # re-rotation copies to make before the forward (all layers): src slot -> dst slot, old -> new position
    rerotate: tuple[list[IntList], list[IntList], list[IntList], list[IntList]] = field(
        default_factory=lambda: ([], [], [], [])
    )  # columns of chunks, one chunk per request
    # sampling: which token rows produce a next token, with which parameters, seed and output index
    sample_rows: list[int] = field(default_factory=list)
    sample_params: list[SamplingParams] = field(default_factory=list)
    sample_seeds: list[int] = field(default_factory=list)
    sample_counters: list[int] = field(default_factory=list)
    sample_penalty_rows: list[int] = field(default_factory=list)  # row of the penalty tables, -1: none
    # penalty-table rows to (re)fill before the step: (row, prompt ids, output ids so far)
    penalty_resets: list[tuple[int, list[int], list[int]]] = field(default_factory=list)
    # structured outputs: the sample rows with a grammar, and the tokens each may sample as a bitmask
    # [len(mask_rows), ceil(V / 32)] int32 (bit j of word w: token 32 w + j), filled by their matchers
    mask_rows: list[int] = field(default_factory=list)
    token_mask: np.ndarray | None = None
    # the scheduler's own note, which the worker never reads: the request of each sample row
    scheduled: list[Any] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_copies(self) -> int:
        return sum(map(len, self.rerotate[0]))

    def add_segment_keys(self, slots: IntList, positions: IntList) -> None:
        """Close one segment piece with the slots and positions of the keys it sees from before it."""
        self.seg_kv_slots.append(slots)
        self.seg_kv_pos.append(positions)
        self.seg_kv_indptr.append(self.seg_kv_indptr[-1] + len(slots))

    def decode_key_writes(self) -> tuple[list[IntList], ...]:
        """The decode queries' own keys as key-table writes (row, column, slot, position), one chunk each: the
        token's row, the row's last column after this step, the token's slot and position."""
        n = self.num_decode
        cols = np.asarray(self.decode_lens, dtype=np.int64) - 1
        return [self.decode_rows], [cols], [self.slots[:n]], [self.positions[:n]]

    def write_row(self, row: int, start: int, slots: IntList, positions: IntList) -> None:
        """Write keys into a key-table row from column `start` on."""
        n = len(slots)
        rows, cols, s, p = self.table_writes
        rows.append(np.full(n, row, dtype=np.int64))
        cols.append(np.arange(start, start + n, dtype=np.int64))
        s.append(slots)
        p.append(positions)


def host_int64(chunks: list[IntList], pin: bool) -> torch.Tensor:
    """The concatenated int chunks (lists or numpy arrays) as one int64 CPU tensor (pinned for an
    asynchronous copy to a GPU). numpy is ~4x faster than torch.tensor on a Python list."""
    parts = [c if isinstance(c, np.ndarray) else np.fromiter(c, dtype=np.int64, count=len(c)) for c in chunks]
    flat = np.concatenate(parts).astype(np.int64, copy=False) if parts else np.zeros(0, dtype=np.int64)
    out = torch.from_numpy(flat)
    return out.pin_memory() if pin else out


def flatten(columns: list[list[IntList]]) -> tuple[list[IntList], list[int]]:
    """Chunks of several columns in one list, and each column's length (to split the copy again)."""
    return list(chain(*columns)), [sum(map(len, c)) for c in columns]
