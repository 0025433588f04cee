"""Worker processes, started and supervised by the engine; here: one worker doing prefill and decode.

`Engine(model, prefill_devices=["cpu"])` (or `decode_devices` alone; any one device) runs the model, the KV
tensors and the `Worker` in a spawned child process; the engine's thread keeps the scheduler and talks to
the child through `WorkerProcess`, which has the worker's interface (`launch(batch) -> handle`,
`collect(handle) -> result`). With both device lists the engine runs pools of prefill and decode children
instead (minakv/worker/disagg.py). Under tensor / expert parallelism (`tensor_parallel_size`,
`expert_parallel_size`) the one worker is `world = max(tp, ep)` children, ranks of one group that each hold
their share of the model and its KV (minakv/parallel/); every rank gets every batch (minakv/worker/ranks.py):

    parent: engine thread, scheduler                        children: Worker, model, KV (on their devices)
      launch(batch N)    -- (N, ForwardBatch) --> queues -->  every rank: Worker.launch + collect, in order
      collect(handle N)  <-- (N, StepResult)  --  pipes  <--  rank 0's tokens (or (N, Failed): the step raised)

A `ForwardBatch` is plain data (lists, numpy arrays, sampling parameters), so it pickles as it is (without
the scheduler's note of its requests). Overlap keeps working: the engine sends batch N + 1 before it reads
step N's tokens, the children serve the batches in order, and ids that reference step N's samples
(`-(row + 1)`) resolve in each child as they do in process. Batches go through a queue, whose feeder
thread writes the pipe, so `launch` never blocks the engine thread even when a batch is larger than the
pipe's buffer (a child may be busy sending a large result meanwhile).

Supervision: while the parent waits for the children (start-up or a step's result), it polls their pipes
with a short timeout and checks that every child it watches is alive. A killed or crashed child closes its
end of the pipe, so the wait ends at once with `WorkerDied`; the engine then ends the requests it holds with
an error, forgets every cached page (their KV died with the child) and calls `restart()`, which stops every
rank and starts fresh ones with the same pool size (the scheduler's page numbers stay valid). A child whose
parent died exits within a second. Children are daemons: multiprocessing terminates them at interpreter
exit; `close()` stops them.

`torch.distributed`: the children join one process group (NCCL on CUDA, gloo on CPU, the same code) and
wait at a barrier until every one holds its model and its KV. One worker is a group of `world` ranks; N
prefill and M decode workers are `(N + M) * world` ranks, the prefill workers first, which send KV to each
other (minakv/worker/transfer.py). The parent stays out of it: it has no device, and NCCL needs one per rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from minakv.config import EngineConfig
from minakv.model import ModelConfig
from minakv.worker.batch import ForwardBatch
from minakv.worker.ranks import (
    Child,
    WorkerDied,
    backend_for,
    check_alive,
    close_all,
    group_address,
    result_of,
    wait_ready,
)
from minakv.worker.worker import StepResult

logger = logging.getLogger(__name__)

__all__ = ["Handle", "RemoteModel", "WorkerDied", "WorkerProcess"]


@dataclass
class RemoteModel:
    """The parent's stand-in for a model that lives in the worker process: what the scheduler, the prompt
    builder and the server read of it (`engine.model.config`)."""

    config: ModelConfig


@dataclass
class Handle:
    seq: int  # the batch's number: results come back in order, each with its number


class WorkerProcess:
    """One worker doing prefill and decode (`prefill_devices` or `decode_devices` alone, or neither under
    tensor / expert parallelism): `world` processes, ranks of one group."""

    def __init__(self, config: EngineConfig) -> None:
        """Start the children on their devices and wait until they have loaded the model; raises what a
        child raised (a bad model name, a layout the model cannot be cut into: ValueError)."""
        self.config = config
        self.devices = config.role_devices(config.prefill_devices or config.decode_devices)
        self.device = self.devices[0]
        self.restart_note = "restarting the worker" + (
            f" (all {config.world} ranks)" if config.world > 1 else ""
        )
        self.graphs = None  # the CUDA graphs (and the penalty tables) live in the children
        self.penalties = None
        self.ranks: list[Child] = []
        self._start(config.kv_cache_tokens)

    # ----- the worker's interface -----
    def launch(self, batch: ForwardBatch) -> Handle:
        if not self.ranks:
            raise WorkerDied("the worker process is not running")
        check_alive(self.ranks)
        self._seq += 1
        message = (self._seq, replace(batch, scheduled=[]))  # (the requests stay here)
        for child in self.ranks:  # every rank, in the same order: they meet at the same collectives
            child.send(message)
        return Handle(self._seq)

    def collect(self, handle: Handle) -> StepResult:
        """Wait for the step's result. Results of earlier steps the engine dropped (after a failed step) are
        skipped. A step that raised in the children raises here, as a step that raises in process does."""
        if not self.ranks:
            raise WorkerDied("the worker process is not running")
        return result_of(self.ranks, handle.seq, self.ranks)

    # ----- supervision -----
    def restart(self) -> None:
        """Start fresh children with the same pool size, after `WorkerDied`. Their KV is empty, so the engine
        must have ended every request and cleared its cache index first."""
        old = self.num_pages
        self.close(1.0)  # (a rank out of step may be stuck in a collective: little grace, then terminate)
        self._start(old * self.config.page_size)
        if self.num_pages != old:  # the scheduler's page numbers would be wrong
            self.close()
            raise RuntimeError(f"the restarted worker has {self.num_pages} pages, not {old}")

    def close(self, timeout: float = 5.0) -> None:
        """Stop every rank: ask it to exit, then terminate it, then kill it. Idempotent."""
        ranks, self.ranks = self.ranks, []
        close_all(ranks, timeout)

    @property
    def pid(self) -> int | None:
        """Rank 0's process id."""
        return self.ranks[0].pid if self.ranks else None

    @property
    def pids(self) -> list[int]:
        return [c.pid for c in self.ranks]

    def _start(self, kv_cache_tokens: int | None) -> None:
        self._seq = 0
        config = replace(self.config, kv_cache_tokens=kv_cache_tokens)
        (self.ranks,), readies = start_roles(config, [("worker", None, self.devices)])
        ready = readies[0]
        self.model = RemoteModel(ready.model_config)
        self.num_pages = min(r.num_pages for r in readies)
        self.kv_bytes_per_token, self.max_model_len = ready.kv_bytes_per_token, ready.max_model_len
        logger.info("worker process(es) %s on %s: %d KV pages", self.pids, self.devices, self.num_pages)


def start_roles(
    config: EngineConfig, roles: list[tuple[str, int | None, list[str]]]
) -> tuple[list[list[Child]], list]:
    """Spawn every worker's ranks into one group (ranks numbered worker after worker) and wait for every
    `Ready`. `roles`: per worker, (role, which member of its pool or None, one device per rank). Processes
    that share a GPU share its memory: each sizes its pool from a share of the free memory."""
    devices = [d for _, _, ds in roles for d in ds]
    share = max(devices.count(d) for d in devices)
    if devices[0].startswith("cuda") and share > 1 and config.kv_cache_tokens is None:
        config = replace(config, memory_fraction=config.memory_fraction / share)
    backend, group, world = backend_for(devices), group_address(), len(devices)
    children: list[list[Child]] = []
    for role, member, ds in roles:
        first = sum(map(len, children))
        children.append(
            [Child(config, role, d, backend, group, first + i, world, member) for i, d in enumerate(ds)]
        )
    return children, wait_ready([c for cs in children for c in cs])
