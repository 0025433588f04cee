"""Worker processes, started and supervised by the engine; here: one worker doing prefill and decode.

`Engine(model, prefill_devices=["cpu"])` (or `decode_devices` alone; any one device) runs the model, the KV
tensors and the `Worker` in a spawned child process; the engine's thread keeps the scheduler and talks to
the child through `WorkerProcess`, which has the worker's interface (`launch(batch) -> handle`,
`collect(handle) -> result`). With both device lists the engine runs a prefill and a decode child instead
(minakv/worker/disagg.py); both are a `Child` of this module:

    parent: engine thread, scheduler                        child: Worker, model, KV (on its device)
      launch(batch N)    -- (N, ForwardBatch) --> queue -->   Worker.launch + Worker.collect, in order
      collect(handle N)  <-- (N, StepResult)  --  pipe  <--   (or (N, Failed) when the step raised)

A `ForwardBatch` is plain data (lists, numpy arrays, sampling parameters), so it pickles as it is (without
the scheduler's note of its requests). Overlap keeps working: the engine sends batch N + 1 before it reads
step N's tokens, the child serves the batches in order, and ids that reference step N's samples
(`-(row + 1)`) resolve in the child as they do in process. Batches go through a queue, whose feeder thread
writes the pipe, so `launch` never blocks the engine thread even when a batch is larger than the pipe's
buffer (the child may be busy sending a large result meanwhile).

Supervision: while the parent waits for a child (start-up or a step's result), it polls the result pipe
with a short timeout and checks that every child it watches is alive. A killed or crashed child closes its
end of the pipe, so the wait ends at once with `WorkerDied`; the engine then ends the requests it holds with
an error, forgets every cached page (their KV died with the child) and calls `restart()`, which starts fresh
children with the same pool size (the scheduler's page numbers stay valid). A child whose parent died exits
within a second. Children are daemons: multiprocessing terminates them at interpreter exit; `close()` stops
them.

`torch.distributed`: each child joins a process group of the workers (NCCL on CUDA, gloo on CPU, the same
code) and waits at a barrier until every worker holds its model and its KV. One worker is a group of one
rank; a prefill/decode pair is ranks 0 and 1, which send KV to each other (minakv/worker/transfer.py). The
parent stays out of it: it has no device, and NCCL needs one per rank.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, replace

import torch
import torch.multiprocessing as mp

from minakv.config import EngineConfig
from minakv.model import ModelConfig
from minakv.worker.batch import ForwardBatch
from minakv.worker.child import Failed, Ready, serve
from minakv.worker.worker import StepResult

logger = logging.getLogger(__name__)

POLL_S = 0.1  # how often a waiting parent checks that the child is alive


class WorkerDied(RuntimeError):
    """The worker process is gone (killed, crashed): the KV it held is lost."""


@dataclass
class RemoteModel:
    """The parent's stand-in for a model that lives in the worker process: what the scheduler, the prompt
    builder and the server read of it (`engine.model.config`)."""

    config: ModelConfig


@dataclass
class Handle:
    seq: int  # the batch's number: results come back in order, each with its number


class WorkerProcess:
    """One worker process doing prefill and decode (`prefill_devices` or `decode_devices` alone)."""

    restart_note = "restarting the worker"  # what the engine says it does after a death

    def __init__(self, config: EngineConfig) -> None:
        """Start the child on its device and wait until it has loaded the model; raises what the child
        raised (a bad model name: ValueError)."""
        self.config = config
        self.device = (config.prefill_devices or config.decode_devices or ["cpu"])[0]
        self.graphs = None  # the CUDA graphs (and the penalty tables) live in the child
        self.penalties = None
        self.child: Child | None = None
        self._start(config.kv_cache_tokens)

    # ----- the worker's interface -----
    def launch(self, batch: ForwardBatch) -> Handle:
        if self.child is None or not self.child.alive():
            raise self._died()
        self._seq += 1
        self.child.send((self._seq, replace(batch, scheduled=[])))  # (the requests stay here)
        return Handle(self._seq)

    def collect(self, handle: Handle) -> StepResult:
        """Wait for the step's result. Results of earlier steps the engine dropped (after a failed step) are
        skipped. A step that raised in the child raises here, as a step that raises in process does."""
        if self.child is None:
            raise self._died()
        return result_of(self.child, handle.seq, [self.child])

    # ----- supervision -----
    def restart(self) -> None:
        """Start a fresh child with the same pool size, after `WorkerDied`. Its KV is empty, so the engine
        must have ended every request and cleared its cache index first."""
        old = self.num_pages
        self.close()
        self._start(old * self.config.page_size)
        if self.num_pages != old:  # the scheduler's page numbers would be wrong
            self.close()
            raise RuntimeError(f"the restarted worker has {self.num_pages} pages, not {old}")

    def close(self, timeout: float = 5.0) -> None:
        """Stop the child: ask it to exit, then terminate it, then kill it. Idempotent."""
        child, self.child = self.child, None
        if child is not None:
            child.close(timeout)

    @property
    def pid(self) -> int | None:
        return self.child.pid if self.child is not None else None

    @property
    def pids(self) -> list[int]:
        return [self.pid] if self.pid is not None else []

    def _start(self, kv_cache_tokens: int | None) -> None:
        self._seq = 0
        config = replace(self.config, kv_cache_tokens=kv_cache_tokens)
        backend = "nccl" if self.device.startswith("cuda") else "gloo"
        self.child = Child(config, "worker", self.device, backend, group_address(), rank=0, world=1)
        ready = wait_ready([self.child])[0]
        self.model = RemoteModel(ready.model_config)
        self.num_pages, self.kv_bytes_per_token = ready.num_pages, ready.kv_bytes_per_token
        self.max_model_len = ready.max_model_len
        logger.info("worker process %d on %s: %d KV pages", self.child.pid, self.device, self.num_pages)

    def _died(self) -> WorkerDied:
        return WorkerDied("the worker process is not running") if self.child is None else self.child.died()


class Child:
    """One worker process: spawned, fed batches over a queue, answering over a pipe; `role` names it in
    errors ("worker", "prefill", "decode")."""

    def __init__(
        self, config: EngineConfig, role: str, device: str, backend: str, group: str, rank: int, world: int
    ) -> None:
        ctx = mp.get_context(
            "spawn"
        )  # fork is unsafe with threads and CUDA; spawn starts a clean interpreter
        self.role, self.device = role, device
        self.batches = ctx.Queue()
        self.batches.cancel_join_thread()  # never hang the parent's exit on a batch a dead child never read
        self.results, child_end = ctx.Pipe(duplex=False)
        config = replace(config, device=device, prefill_devices=None, decode_devices=None)
        self.process = ctx.Process(
            target=serve,
            args=(config, child_end, self.batches, torch.get_num_threads(), group, rank, world, backend),
            name=f"minakv-{role}",
            daemon=True,
        )
        self.process.start()
        child_end.close()  # only the child holds the writing end: its death is an end of file here

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.is_alive()

    def send(self, message: object) -> None:
        self.batches.put(message)

    def died(self) -> WorkerDied:
        self.process.join(1.0)
        name = "worker process" if self.role == "worker" else f"{self.role} worker process"
        return WorkerDied(
            f"the {name} (pid {self.pid}, {self.device}) died (exit code {self.process.exitcode})"
        )

    def close(self, timeout: float = 5.0) -> None:
        """Ask the child to exit, then terminate it, then kill it."""
        process = self.process
        if process.is_alive():
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


def receive(child: Child, watch: list[Child]) -> tuple[int, object]:
    """`child`'s next message; `WorkerDied` as soon as any child in `watch` is gone, never a hang (a live
    child may be blocked sending to a dead one)."""
    try:
        while not child.results.poll(POLL_S):
            for c in watch:
                if not c.alive():
                    raise c.died()
        return child.results.recv()
    except (EOFError, OSError):
        raise child.died() from None


def result_of(child: Child, seq: int, watch: list[Child]) -> StepResult:
    """The result of step `seq` from `child` (older results, of steps the engine dropped, are skipped)."""
    while True:
        got, reply = receive(child, watch)
        if got < seq:
            continue
        if isinstance(reply, Failed):
            if reply.kind == "TransferError":  # the pair is broken: name the one that died, if one did
                for other in watch:
                    other.process.join(0.5 if other is not child else 0)
                    if other is not child and not other.alive():
                        raise other.died()
                raise WorkerDied(f"the {child.role} worker process stopped: {reply.message}")
            raise RuntimeError(f"worker step failed: {reply.kind}: {reply.message}\n{reply.trace}")  # noqa: TRY004
        return reply


def wait_ready(children: list[Child]) -> list[Ready]:
    """Every child's `Ready`; if one fails or dies, stop them all and raise (a bad model name: ValueError)."""
    readies = []
    try:
        for child in children:
            _, ready = receive(child, children)
            if isinstance(ready, Failed):
                error = ValueError if ready.kind in ("ValueError", "FileNotFoundError") else RuntimeError
                raise error(f"the worker process could not start: {ready.message}")
            readies.append(ready)
    except BaseException:
        for child in children:
            child.close(1.0)
        raise
    return readies


def group_address() -> str:
    """Where rank 0 serves the workers' process group (a free local port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"
