"""Which worker of a pool runs what: decode requests pinned to a decode worker, prefill work sticky.

With N prefill and M decode workers (docs/workers.md, "Pools") each step's prefill part and decode part
(minakv/worker/split.py) are cut further, one piece per worker:

- **Decode.** A request lives in one decode worker from its first decode step to its end: its key-table row
  and its penalty counts are there. The row is pinned when it is written from column 0 (a request starts
  decoding, or starts again after a preemption) to the decode worker with the fewest decoding requests, ties
  broken by the fewest pages it lacks (the next round of an agent goes where its history is).
- **Prefill.** The segment pieces and re-rotation copies of a step form groups: items that touch a page one
  of them writes belong together (a request's pieces read the keys its earlier pieces write in the same
  step), so no page is written on one worker while another uses it. Each group goes to the prefill worker
  where it costs least: the tokens already given to that worker this step, plus the pages it lacks, each
  weighed as `TRANSFER_WEIGHT` of a page's tokens. So a request's next chunk, or an agent's next round,
  goes where its KV already is (sticky), a new request goes to the least loaded worker, and a shared prefix
  that pins too much work to one worker is copied to another once it pays.

Groups follow the page numbers: no request identities are needed, and the cut is right by construction.
"""

from __future__ import annotations

import numpy as np

from minakv.worker.batch import ForwardBatch
from minakv.worker.coherence import Coherence
from minakv.worker.split import pages_of

TRANSFER_WEIGHT = 0.25  # moving a page costs about a quarter of computing its tokens again (a guess)


class Placement:
    def __init__(self, prefill: list[int], decode: list[int]) -> None:
        """`prefill`, `decode`: the holders (coherence table rows) of each pool's workers."""
        self.prefill, self.decode = prefill, decode
        self.home: dict[int, int] = {}  # key-table row -> index of its decode worker

    def clear(self) -> None:
        self.home.clear()

    def place_decodes(self, part: ForwardBatch, table: Coherence, page_size: int) -> list[list[int]]:
        """Per decode worker, the indices of the part's decode queries it runs (in the batch's order)."""
        rows, writes = part.decode_rows, part.table_writes
        starts: dict[int, list] = {}  # rows written from column 0 this step -> the slots they read
        for r, c, s in zip(writes[0], writes[1], writes[2]):
            if len(r) and (int(r[0]) in starts or int(c[0]) == 0):
                starts.setdefault(int(r[0]), []).append(s)
        for row, slot in zip(rows, part.slots):  # their queries' own keys (ForwardBatch.decode_key_writes)
            if row in starts:
                starts[row].append([slot])
        load = [0] * len(self.decode)
        for row in rows:
            if row not in starts:
                if row not in self.home:
                    raise RuntimeError(
                        f"key-table row {row} decodes but was never started on a decode worker"
                    )
                load[self.home[row]] += 1
        for row in (r for r in rows if r in starts):
            pages = pages_of(starts[row], page_size)
            lacking = [len(table.lacking(h, pages)) for h in self.decode]
            m = min(range(len(self.decode)), key=lambda i: (load[i], lacking[i], i))
            self.home[row] = m
            load[m] += 1
        cut: list[list[int]] = [[] for _ in self.decode]
        for i, row in enumerate(rows):
            cut[self.home[row]].append(i)
        return cut

    def place_prefill(
        self, part: ForwardBatch, table: Coherence, page_size: int
    ) -> list[tuple[list[int], list[int]]]:
        """Per prefill worker, (the segment pieces, the re-rotation chunks) it runs, each in the part's order."""
        pieces, copies = len(part.seg_kv_slots), len(part.rerotate[0])
        q = part.seg_q_indptr
        reads = [pages_of([part.seg_kv_slots[p]], page_size) for p in range(pieces)]
        reads += [pages_of([part.rerotate[0][c]], page_size) for c in range(copies)]
        writes = [pages_of([part.slots[q[p] : q[p + 1]]], page_size) for p in range(pieces)]
        writes += [pages_of([part.rerotate[1][c]], page_size) for c in range(copies)]
        tokens = [q[p + 1] - q[p] for p in range(pieces)] + [0] * copies
        group = _groups(reads, writes)
        load = [0.0] * len(self.prefill)
        cut: list[tuple[list[int], list[int]]] = [([], []) for _ in self.prefill]
        members: dict[int, list[int]] = {}  # group -> its items (groups in the order of their first item)
        for i, g in enumerate(group):
            members.setdefault(g, []).append(i)
        for items in members.values():
            pages = np.unique(np.concatenate([reads[i] for i in items] + [writes[i] for i in items]))
            work = sum(tokens[i] for i in items)
            cost = [load[k] + TRANSFER_WEIGHT * page_size * len(table.lacking(h, pages))
                    for k, h in enumerate(self.prefill)]  # fmt: skip
            k = min(range(len(self.prefill)), key=lambda i: (cost[i], i))
            load[k] += work
            cut[k][0].extend(i for i in items if i < pieces)
            cut[k][1].extend(i - pieces for i in items if i >= pieces)
        return [(sorted(p), sorted(c)) for p, c in cut]  # (the batch's order within each worker)


def _groups(reads: list[np.ndarray], writes: list[np.ndarray]) -> list[int]:
    """Union-find over items: two items are joined when one touches a page the other writes. Returns each
    item's group (the smallest item index in it)."""
    parent = list(range(len(reads)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def join(a: int, b: int) -> None:
        a, b = root(a), root(b)
        parent[max(a, b)] = min(a, b)

    owner = np.repeat(np.arange(len(writes)), [len(w) for w in writes])
    written = np.concatenate(writes) if writes else np.zeros(0, dtype=np.int64)
    order = np.argsort(written, kind="stable")
    written, owner = written[order], owner[order]
    for a, b in zip(owner[:-1][np.diff(written) == 0], owner[1:][np.diff(written) == 0]):
        join(int(a), int(b))  # two items write the same page
    for i, pages in enumerate(reads):
        at = np.searchsorted(written, pages)
        hit = at < len(written)
        hit[hit] = written[at[hit]] == pages[hit]
        for w in np.unique(owner[at[hit]]):
            join(i, int(w))  # item i reads a page item w writes
    return [root(i) for i in range(len(reads))]
