"""The parent's end of the worker processes: spawn them, feed them, read their answers, notice their death.

Every worker process is a `Child`: one rank of the workers' `torch.distributed` group. One role (a worker
doing prefill and decode, or one worker of the prefill or the decode pool) is `world = max(tp, ep)` ranks that
hold one copy of the model between them (minakv/parallel/). The parent sends every step to every rank of a
role, in the same order, so the ranks meet at the same collectives; rank 0 answers with the step's
tokens, the others with `None` (every rank samples the same tokens: each needs them for the next step's
inputs), or each with `Failed` when the step raised.

    parent                                  children (ranks of one role)
      send (seq, batch) to every rank  -->  rank 0 .. rank w-1: launch + collect, in order
      result_of(ranks, seq)           <--   rank 0: (seq, StepResult); others: (seq, None) or (seq, Failed)

Supervision: while waiting, the parent polls every rank's pipe and checks that every child it watches is
alive. A killed child closes its end of the pipe, so the wait ends at once with `WorkerDied` (a rank
blocked in a collective with the dead one gets a gloo/NCCL error, answers a fatal `Failed` and exits). A
step every rank failed is a failed step (the engine quarantines its requests, as in process); a step only
some ranks failed leaves them out of step, which is a death too: the engine restarts every rank.
"""

from __future__ import annotations

import socket
import time
from dataclasses import replace
from multiprocessing.connection import wait

import torch
import torch.multiprocessing as mp

from minakv.config import EngineConfig
from minakv.worker.child import Failed, Ready, serve
from minakv.worker.worker import StepResult

POLL_S = 0.1  # how often a waiting parent checks that the children are alive
OUT_OF_STEP_S = 2.0  # after one rank failed a step, how long the others get to answer (else: out of step)


class WorkerDied(RuntimeError):
    """A worker process is gone (killed, crashed) or its ranks are out of step: the KV they held is lost."""


class Child:
    """One worker process: spawned, fed over a queue, answering over a pipe. `role` ("worker", "prefill",
    "decode"), `member` (which worker of a pool of several, else None) and its rank in the worker name it in
    errors; `rank` and `world` place it in the group."""

    def __init__(
        self,
        config: EngineConfig,
        role: str,
        device: str,
        backend: str,
        group: str,
        rank: int,
        world: int,
        member: int | None = None,
    ) -> None:
        ctx = mp.get_context(
            "spawn"
        )  # fork is unsafe with threads and CUDA; spawn starts a clean interpreter
        self.role, self.device, self.role_rank = role, device, rank % config.world
        self.batches = ctx.Queue()
        self.batches.cancel_join_thread()  # never hang the parent's exit on a batch a dead child never read
        self.results, child_end = ctx.Pipe(duplex=False)
        config = replace(config, device=device, prefill_devices=None, decode_devices=None)
        self.process = ctx.Process(
            target=serve,
            args=(config, child_end, self.batches, torch.get_num_threads(), group, rank, world, backend),
            name=f"minakv-{role}{'' if member is None else member}-{self.role_rank}",
            daemon=True,
        )
        self.process.start()
        child_end.close()  # only the child holds the writing end: its death is an end of file here
        self.name = "worker process" if role == "worker" else f"{role} worker process"
        if member is not None:
            self.name = f"{role} worker {member} process"
        if config.world > 1:
            self.name += f" rank {self.role_rank}"

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.is_alive()

    def send(self, message: object) -> None:
        self.batches.put(message)

    def died(self) -> WorkerDied:
        self.process.join(1.0)
        return WorkerDied(
            f"the {self.name} (pid {self.pid}, {self.device}) died (exit code {self.process.exitcode})"
        )

    def close(self, timeout: float = 5.0) -> None:
        """Ask the child to exit, then terminate it, then kill it."""
        process = self.process
        if process.is_alive() and timeout > 0:
            self.batches.put(None)
            process.join(timeout)
        if process.is_alive():
            process.terminate()
            process.join(1.0)
        if process.is_alive():
            process.kill()
            process.join(1.0)
        self.batches.close()
        self.results.close()


def check_alive(children: list[Child]) -> None:
    for child in children:
        if not child.alive():
            raise child.died()


def close_all(children: list[Child], timeout: float = 5.0) -> None:
    """Stop every child. If one is dead the others may be blocked on it: no grace period then."""
    if any(not c.alive() for c in children):
        timeout = 0.0
    for child in children:
        child.close(timeout)


def result_of(ranks: list[Child], seq: int, watch: list[Child]) -> StepResult:
    """Step `seq`'s result once every rank of the role answered: rank 0's tokens. Older answers (of steps
    the engine dropped) are skipped; `WorkerDied` as soon as any child in `watch` is gone, never a hang (a
    live child may be blocked on a dead one). A step every rank failed raises here, as one in process does."""
    replies: dict[int, object] = {}
    deadline = None
    while len(replies) < len(ranks):
        waiting = {ranks[i].results: i for i in range(len(ranks)) if i not in replies}
        ready = wait(list(waiting), POLL_S)
        for conn in ready:
            child = ranks[waiting[conn]]
            try:
                got, reply = conn.recv()
            except (EOFError, OSError):
                raise child.died() from None
            if got < seq:
                continue
            if isinstance(reply, Failed) and reply.fatal:
                raise _stopped(child, reply, watch)
            replies[waiting[conn]] = reply
        if not ready:
            check_alive(watch)
        if deadline is None and any(isinstance(r, Failed) for r in replies.values()):
            deadline = time.monotonic() + OUT_OF_STEP_S
        if deadline is not None and len(replies) < len(ranks) and time.monotonic() > deadline:
            raise WorkerDied(f"the {ranks[0].name} ranks are out of step: some failed step {seq}, some hang")
    failed = {i: r for i, r in replies.items() if isinstance(r, Failed)}
    if failed and len(failed) < len(ranks):
        i, reply = next(iter(failed.items()))
        raise WorkerDied(f"the {ranks[i].name} alone failed step {seq} ({reply.kind}: {reply.message})")
    if failed:
        reply = failed[0]
        raise RuntimeError(f"worker step failed: {reply.kind}: {reply.message}\n{reply.trace}")
    return replies[0]  # type: ignore[return-value]


def _stopped(child: Child, reply: Failed, watch: list[Child]) -> WorkerDied:
    """A child stopped after a broken transfer or collective: name the one that died, if one did."""
    for other in watch:
        other.process.join(0.5 if other is not child else 0)
        if other is not child and not other.alive():
            return other.died()
    return WorkerDied(f"the {child.name} stopped: {reply.message}")


def wait_ready(children: list[Child]) -> list[Ready]:
    """Every child's `Ready`; if one fails or dies, stop them all and raise (a bad model name, a layout the
    model cannot be cut into: ValueError)."""
    readies = []
    try:
        for child in children:
            while not child.results.poll(POLL_S):
                check_alive(children)
            try:
                _, ready = child.results.recv()
            except (EOFError, OSError):
                raise child.died() from None
            if isinstance(ready, Failed):
                bad_input = ready.kind in ("ValueError", "FileNotFoundError", "ParallelError")
                raise (ValueError if bad_input else RuntimeError)(
                    f"the worker process could not start: {ready.message}"
                )
            readies.append(ready)
    except BaseException:
        close_all(children, 1.0)
        raise
    return readies


def backend_for(devices: list[str]) -> str:
    """NCCL wants one GPU per rank; processes sharing a GPU talk through host memory over gloo."""
    cuda = devices[0].startswith("cuda")
    return "nccl" if cuda and len(set(devices)) == len(devices) else "gloo"


def group_address() -> str:
    """Where rank 0 serves the workers' process group (a free local port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"
