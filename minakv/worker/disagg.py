"""Prefill/decode disaggregation: a prefill worker process and a decode worker process, one page pool.

`Engine(model, prefill_devices=[A], decode_devices=[B])` starts two worker processes (A and B may be the same
device), ranks 0 and 1 of one `torch.distributed` group (gloo on CPU, NCCL on two GPUs; the parent stays
out of it). Under tensor / expert parallelism each side is `w = max(tp, ep)` ranks (prefill ranks 0..w-1,
decode ranks w..2w-1, one device each), every rank of a side gets that side's part, and prefill rank i
trades KV with decode rank i (minakv/worker/transfer.py); both sides use the same tp and ep. `DisaggWorkers` has the worker's interface (`launch`, `collect`), so the engine and the scheduler
run as with one worker; each step it

    1. splits the batch: decode queries to the decode worker, segments and copies to the prefill worker
       (minakv/worker/split.py);
    2. plans the transfers from the coherence table (minakv/worker/coherence.py): the pages each side is
       about to read or write but does not hold in their current version. A request that starts decoding
       needs its final active KV on the decode side; only pages it lacks move (a shared prefix or an earlier
       round stay there). Generated tokens' KV, written by the decode side, goes back when the prefill side
       next reads it (the next round's restore), so the next round does not recompute the previous answer;
    3. sends each worker its `Part` (minakv/worker/transfer.py): its share, the transfers, the step's
       stamps, and whether the decode side needs the prefill side's samples of the step before (a request
       whose prompt ended there decodes now from that token, still on the prefill device);
    4. collects both results: the decode part's tokens, then the prefill part's (the batch's sample order).

Both workers allocate the same pool size, so a slot means the same place on both sides: transfers copy
pages to the same page numbers, and the scheduler, its index and its page accounting stay as they are.

Faults: if either process dies (or a transfer between them breaks), the other may be blocked in a send or
receive to it; the parent stops both, and the engine restarts the pair (the KV of both is gone).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np

from minakv.config import EngineConfig
from minakv.worker.batch import ForwardBatch
from minakv.worker.coherence import DECODE, PREFILL, Coherence, StepPlan
from minakv.worker.process import RemoteModel, start_roles
from minakv.worker.ranks import Child, check_alive, close_all, result_of
from minakv.worker.split import reads_and_writes, split_batch
from minakv.worker.transfer import Part
from minakv.worker.worker import StepResult

logger = logging.getLogger(__name__)

COUNTERS = ("kv_pages_to_decode", "kv_bytes_to_decode", "kv_pages_to_prefill", "kv_bytes_to_prefill",
            "kv_pages_decode_had")  # fmt: skip


@dataclass
class PairHandle:
    seq: int
    sides: tuple[bool, bool]  # did the prefill / decode worker get a part of this step


class DisaggWorkers:
    restart_note = "restarting the workers (prefill and decode: the KV of both is lost)"

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.devices = (
            config.role_devices(config.prefill_devices),
            config.role_devices(config.decode_devices),
        )
        if config.world > 1:
            self.restart_note = f"restarting the workers (prefill and decode, {config.world} ranks each: the KV of both is lost)"
        self.graphs = None  # CUDA graphs and penalty tables live in the children
        self.penalties = None
        self.roles: list[list[Child]] = []  # the prefill side's ranks, the decode side's
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._start(config.kv_cache_tokens)

    # ----- the worker's interface -----
    def launch(self, batch: ForwardBatch) -> PairHandle:
        check_alive(self.children)
        self._seq += 1
        seq = self._seq
        prefill, decode = split_batch(batch)
        reads, writes = zip(*reads_and_writes(prefill, decode, self.config.page_size))
        plan = self.coherence.plan(reads, writes)
        self._count(plan)
        last_seq, last_decode, last_prefill = self._last
        follows = last_seq == seq - 1  # (-(j + 1) inputs reference the samples of the launch just before)
        tokens = 0
        if decode is not None and follows and last_prefill:
            ids = np.asarray(decode.input_ids, dtype=np.int64)
            if (-ids[ids < 0] - 1 >= last_decode).any():  # it reads samples the prefill worker holds
                tokens = last_prefill
        parts = (
            Part(seq, prefill, plan.to_decode, plan.to_prefill, tokens, written=plan.written[PREFILL]),
            Part(seq, decode, plan.to_prefill, plan.to_decode, tokens, follows and last_decode > 0,
                 written=plan.written[DECODE]),
        )  # fmt: skip
        sides = []
        for ranks, part in zip(self.roles, parts):
            busy = part.batch is not None or part.tokens > 0 or len(part.send) > 0 or len(part.recv) > 0
            if busy:
                for child in ranks:
                    child.send((seq, part))
            sides.append(busy)
        self._last = (
            seq,
            len(decode.sample_rows) if decode else 0,
            len(prefill.sample_rows) if prefill else 0,
        )
        return PairHandle(seq, (sides[PREFILL], sides[DECODE]))

    def collect(self, handle: PairHandle) -> StepResult:
        """Both parts' results: the decode part's tokens first (the batch's sample-row order)."""
        results = {}
        for side in (DECODE, PREFILL):
            if handle.sides[side]:
                results[side] = result_of(self.roles[side], handle.seq, self.children)
        empty = StepResult([], [])
        d, p = results.get(DECODE, empty), results.get(PREFILL, empty)
        return StepResult(d.tokens + p.tokens, d.logprobs + p.logprobs)

    def fresh(self, page: int) -> None:
        """The scheduler allocated `page`: what it held is garbage nobody reads (no transfer needed)."""
        self.coherence.fresh(page)

    def stats(self) -> dict[str, int]:
        return dict(self.counters)

    # ----- supervision -----
    def restart(self) -> None:
        """Start a fresh pair with the same pool, after `WorkerDied`: the engine has ended every request and
        cleared its index, and the coherence table starts empty (no page holds anything on either side)."""
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
        """Every rank of both sides: the prefill side's first."""
        return [c for ranks in self.roles for c in ranks]

    @property
    def pid(self) -> int | None:
        """The prefill worker's (rank 0's) process id."""
        return self.roles[PREFILL][0].pid if self.roles else None

    @property
    def pids(self) -> list[int]:
        return [c.pid for c in self.children]

    def _start(self, kv_cache_tokens: int | None) -> None:
        self._seq = 0
        self._last = (-1, 0, 0)  # the last launch: its number, and how many samples each side drew
        config = replace(self.config, kv_cache_tokens=kv_cache_tokens)
        self.roles, readies = start_roles(config, [("prefill", self.devices[0]), ("decode", self.devices[1])])
        ready = readies[0]
        self.model = RemoteModel(ready.model_config)
        # each side sized its pool from its own devices: the pages all have are the pool
        self.num_pages = min(r.num_pages for r in readies)
        self.kv_bytes_per_token, self.max_model_len = ready.kv_bytes_per_token, ready.max_model_len
        self.coherence = Coherence(self.num_pages)
        logger.info(
            "prefill workers %s on %s, decode workers %s on %s: %d KV pages each",
            *([c.pid for c in self.roles[PREFILL]], self.devices[PREFILL]),
            *([c.pid for c in self.roles[DECODE]], self.devices[DECODE]),
            self.num_pages,
        )

    def _count(self, plan: StepPlan) -> None:
        per_page = self.config.page_size * self.kv_bytes_per_token
        c = self.counters
        c["kv_pages_to_decode"] += len(plan.to_decode)
        c["kv_bytes_to_decode"] += len(plan.to_decode) * per_page
        c["kv_pages_to_prefill"] += len(plan.to_prefill)
        c["kv_bytes_to_prefill"] += len(plan.to_prefill) * per_page
        c["kv_pages_decode_had"] += plan.decode_held
