"""Prefill/decode disaggregation: pools of N prefill and M decode worker processes, one page pool.

`Engine(model, prefill_devices=[A, B], decode_devices=[C])` starts one worker process per device (2:1 here;
1:1 with one device each; a device may repeat), all in one `torch.distributed` group (gloo on CPU, NCCL on
GPUs; the parent stays out of it). The workers are numbered: prefill 0..N-1, then decode N..N+M-1. Under
tensor / expert parallelism each worker is `w = max(tp, ep)` ranks (worker k: global ranks k*w..k*w+w-1,
one device each), every rank of a worker gets that worker's part, and rank i of one worker trades KV with
rank i of another (minakv/worker/transfer.py). `DisaggWorkers` has the worker's interface (`launch`,
`collect`), so the engine and the scheduler run as with one worker; each step it

    1. splits the batch: decode queries to the decode pool, segments and copies to the prefill pool
       (minakv/worker/split.py), and cuts each pool's part per worker (minakv/worker/placement.py): a
       request decodes on one decode worker from its first decode step on; prefill work goes where its
       pages already are, else to the least loaded prefill worker;
    2. plans the transfers from the coherence table (minakv/worker/coherence.py): the pages each worker is
       about to read or write but does not have in their current version, each sent from a worker that has
       it. A request that starts decoding needs its final active KV on its decode worker; only pages it
       lacks move (a shared prefix or an earlier round stay there). Generated tokens' KV, written by a
       decode worker, goes to a prefill worker when it next reads it (the next round's restore), so the
       next round does not recompute the previous answer;
    3. renumbers the decode inputs that reference the step before's samples (`-(j + 1)`) against the
       samples each worker will see: its own, and those sent to it (a request whose prompt ended on a
       prefill worker decodes now from that token, still on the prefill worker's device);
    4. sends each worker its `Part`, if it has anything to do (work or transfers);
    5. collects the results and puts the tokens back in the batch's sample order.

Every worker allocates the same pool size, so a slot means the same place on each: transfers copy pages to
the same page numbers, and the scheduler, its index and its page accounting stay as they are.

Faults: if any process dies (or a transfer breaks), the others may be blocked in a send or receive to it;
the parent stops all of them, and the engine restarts every worker (the KV of all is gone).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np

from minakv.config import EngineConfig
from minakv.worker.batch import ForwardBatch
from minakv.worker.coherence import Coherence, StepPlan
from minakv.worker.placement import Placement
from minakv.worker.process import RemoteModel, start_roles
from minakv.worker.ranks import Child, check_alive, close_all, result_of
from minakv.worker.split import decode_pages, prefill_pages, split_batch, take_decodes, take_prefill
from minakv.worker.transfer import Part, Transfer
from minakv.worker.worker import StepResult

logger = logging.getLogger(__name__)

COUNTERS = ("kv_pages_to_decode", "kv_bytes_to_decode", "kv_pages_to_prefill", "kv_bytes_to_prefill",
            "kv_pages_decode_had")  # fmt: skip


@dataclass
class PoolHandle:
    seq: int
    busy: list[int]  # the workers that got a part of this step
    order: list[tuple[int, int]]  # per sample row of the batch: (worker, its row in that worker's part)


class DisaggWorkers:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.pools = (config.pool_devices(config.prefill_devices), config.pool_devices(config.decode_devices))
        n, m = len(self.pools[0]), len(self.pools[1])
        self.prefill, self.decode = list(range(n)), list(range(n, n + m))
        kinds = "prefill and decode" if n == m == 1 else f"{n} prefill and {m} decode"
        ranks = f", {config.world} ranks each" if config.world > 1 else ""
        everything = "both" if n == m == 1 else "all"
        self.restart_note = f"restarting the workers ({kinds}{ranks}: the KV of {everything} is lost)"
        self.graphs = None  # CUDA graphs and penalty tables live in the children
        self.penalties = None
        self.roles: list[list[Child]] = []  # per worker (prefill workers first), its ranks
        self.placement = Placement(self.prefill, self.decode)
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._start(config.kv_cache_tokens)

    # ----- the worker's interface -----
    def launch(self, batch: ForwardBatch) -> PoolHandle:
        check_alive(self.children)
        self._seq += 1
        seq = self._seq
        parts, order = self._cut(batch)
        views, samples = self._renumber(seq, parts)
        used = [self._pages(h, part) for h, part in enumerate(parts)]
        plan = self.coherence.plan([reads for reads, _ in used], [writes for _, writes in used])
        self._count(plan)
        transfers = [
            Transfer(src, dst, plan.sends.get((src, dst)), samples.get((src, dst), 0))
            for src, dst in sorted(plan.sends.keys() | samples.keys())
        ]  # the one global order every worker follows (minakv/worker/transfer.py)
        busy = []
        for h, ranks in enumerate(self.roles):
            mine = [t for t in transfers if h in (t.src, t.dst)]
            if parts[h] is not None or mine:
                part = Part(seq, parts[h], mine, views.get(h, []), plan.written[h])
                for child in ranks:
                    child.send((seq, part))
                busy.append(h)
        counts = [0] * len(self.roles)
        for h, _ in order:
            counts[h] += 1
        self._last = (seq, order, counts)
        return PoolHandle(seq, busy, order)

    def collect(self, handle: PoolHandle) -> StepResult:
        """Every busy worker's result; the tokens in the batch's sample-row order."""
        results = {h: result_of(self.roles[h], handle.seq, self.children) for h in handle.busy}
        return StepResult(
            [results[h].tokens[i] for h, i in handle.order], [results[h].logprobs[i] for h, i in handle.order]
        )

    def fresh(self, page: int) -> None:
        """The scheduler allocated `page`: what it held is garbage nobody reads (no transfer needed)."""
        self.coherence.fresh(page)

    def stats(self) -> dict[str, int]:
        return dict(self.counters)

    # ----- one step, cut and renumbered -----
    def _cut(self, batch: ForwardBatch) -> tuple[list[ForwardBatch | None], list[tuple[int, int]]]:
        """Each worker's part of the batch (None: nothing to do), and per sample row of the batch: (worker,
        its row in that worker's part). The batch's sample rows are the decode part's, then the prefill's."""
        prefill, decode = split_batch(batch)
        parts: list[ForwardBatch | None] = [None] * len(self.roles)
        order: list[tuple[int, int]] = []
        # (worker, its part, the rows of its samples among its pool part's samples)
        cuts: list[tuple[int, ForwardBatch, list[int]]] = []
        ps = self.config.page_size
        if decode is not None:
            if len(self.decode) == 1:
                cuts.append((self.decode[0], decode, list(range(len(decode.sample_rows)))))
            else:
                for h, tokens in zip(self.decode, self.placement.place_decodes(decode, self.coherence, ps)):
                    cuts.append((h, *take_decodes(decode, tokens)))
            order += self._order(cuts, len(decode.sample_rows))
        if prefill is not None:
            first = len(cuts)
            if len(self.prefill) == 1:
                cuts.append((self.prefill[0], prefill, list(range(len(prefill.sample_rows)))))
            else:
                placed = self.placement.place_prefill(prefill, self.coherence, ps)
                for h, (pieces, copies) in zip(self.prefill, placed):
                    cuts.append((h, *take_prefill(prefill, pieces, copies)))
            order += self._order(cuts[first:], len(prefill.sample_rows))
        for h, part, _ in cuts:
            if part.num_tokens or part.num_copies or part.table_writes[0] or part.penalty_resets:
                parts[h] = part
        return parts, order

    def _pages(self, h: int, part: ForwardBatch | None) -> tuple[np.ndarray, np.ndarray]:
        """(the pages worker h's part reads, the pages it writes)."""
        if part is None:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        pages = decode_pages if h in self.decode else prefill_pages
        return pages(part, self.config.page_size)

    @staticmethod
    def _order(cuts: list[tuple[int, ForwardBatch, list[int]]], n: int) -> list[tuple[int, int]]:
        """Per sample row of a pool's part (n of them): the worker that samples it, and its row there."""
        order = [(-1, -1)] * n
        for h, _, rows in cuts:
            for i, j in enumerate(rows):
                order[j] = (h, i)
        return order

    def _renumber(
        self, seq: int, parts: list[ForwardBatch | None]
    ) -> tuple[dict[int, list[tuple[int, int]]], dict[tuple[int, int], int]]:
        """Decode inputs `-(j + 1)` name row j of the step before's samples, which may be on any worker.
        Each part's such inputs are renumbered against its *view*: the samples of the workers it references,
        one after another ((worker, count) in order). Returns the views and the samples each worker sends
        another ((src, dst) -> count)."""
        last_seq, last_order, counts = self._last
        views: dict[int, list[tuple[int, int]]] = {}
        samples: dict[tuple[int, int], int] = {}
        for h, part in enumerate(parts):
            ids = np.asarray(part.input_ids if part is not None else [], dtype=np.int64)
            if not (ids < 0).any():
                continue
            if last_seq != seq - 1:
                raise RuntimeError(f"step {seq} references samples of a step that is not the one before")
            rows = -ids[ids < 0] - 1
            where = np.asarray([last_order[j] for j in rows], dtype=np.int64).reshape(-1, 2)
            view = [(int(src), counts[src]) for src in np.unique(where[:, 0])]
            start = dict(zip([src for src, _ in view], np.cumsum([0] + [n for _, n in view]).tolist()))
            ids[ids < 0] = [-(start[int(src)] + int(i) + 1) for src, i in where]
            part.input_ids = ids.tolist()
            views[h] = view
            samples.update({(src, h): n for src, n in view if src != h})
        return views, samples

    # ----- supervision -----
    def restart(self) -> None:
        """Start fresh workers with the same pool, after `WorkerDied`: the engine has ended every request and
        cleared its index, and the coherence table starts empty (no page holds anything anywhere)."""
        old = self.num_pages
        self.close(1.0)  # (a rank out of step may be stuck in a collective: little grace, then terminate)
        self._start(old * self.config.page_size)
        if self.num_pages != old:
            self.close()
            raise RuntimeError(f"the restarted workers have {self.num_pages} pages, not {old}")

    def close(self, timeout: float = 5.0) -> None:
        """Stop every child. If one is dead the others may be blocked on it: no grace period then."""
        children, self.roles = self.children, []
        close_all(children, timeout)

    @property
    def children(self) -> list[Child]:
        """Every rank of every worker: the prefill workers' first."""
        return [c for ranks in self.roles for c in ranks]

    @property
    def pid(self) -> int | None:
        """Prefill worker 0's (rank 0's) process id."""
        return self.roles[0][0].pid if self.roles else None

    @property
    def pids(self) -> list[int]:
        return [c.pid for c in self.children]

    def _start(self, kv_cache_tokens: int | None) -> None:
        self._seq = 0
        self._last: tuple[int, list[tuple[int, int]], list[int]] = (
            -1,
            [],
            [],
        )  # seq, order, samples per worker
        config = replace(self.config, kv_cache_tokens=kv_cache_tokens)
        roles = [
            (role, None if len(pool) == 1 else i, devices)
            for role, pool in zip(("prefill", "decode"), self.pools)
            for i, devices in enumerate(pool)
        ]
        self.roles, readies = start_roles(config, roles)
        ready = readies[0]
        self.model = RemoteModel(ready.model_config)
        # each worker sized its pool from its own devices: the pages all have are the pool
        self.num_pages = min(r.num_pages for r in readies)
        self.kv_bytes_per_token, self.max_model_len = ready.kv_bytes_per_token, ready.max_model_len
        self.coherence = Coherence(self.num_pages, len(self.roles))
        self.placement.clear()
        logger.info(
            "prefill workers %s on %s, decode workers %s on %s: %d KV pages each",
            [[c.pid for c in self.roles[h]] for h in self.prefill], self.pools[0],
            [[c.pid for c in self.roles[h]] for h in self.decode], self.pools[1],
            self.num_pages,
        )  # fmt: skip

    def _count(self, plan: StepPlan) -> None:
        per_page = self.config.page_size * self.kv_bytes_per_token
        c = self.counters
        to_decode = sum(plan.received(h) for h in self.decode)
        to_prefill = sum(plan.received(h) for h in self.prefill)
        c["kv_pages_to_decode"] += to_decode
        c["kv_bytes_to_decode"] += to_decode * per_page
        c["kv_pages_to_prefill"] += to_prefill
        c["kv_bytes_to_prefill"] += to_prefill * per_page
        c["kv_pages_decode_had"] += int(plan.had[self.decode].sum())
