"""The worker process's main: join the workers' process group, build the model and the `Worker`, serve.

The parent (minakv/worker/ranks.py) spawns it and reads its answers: first `Ready` (or `Failed`: a bad
model name, say), then one answer per step, in order. A step is a `ForwardBatch` for a worker doing both
prefill and decode, or a `Part` for one worker of the prefill and decode pools (minakv/worker/transfer.py).

Under tensor / expert parallelism a worker is `w = max(tp, ep)` ranks: this child is rank `rank % w` of
worker `rank // w`, holds that share of the model (minakv/parallel/) and runs every step the worker gets, so
the ranks meet at the same collectives. Every rank samples (the next step's inputs reference the samples, on
each rank); rank 0 answers with the tokens, the others with None. Each worker of the pools gets a subgroup,
and its rank i trades its own kv heads with rank i of the other workers.

A step that raises is answered `Failed` and the child goes on (the engine quarantines the step's requests);
a broken transfer or collective (a peer died, or hangs) ends the child with a fatal `Failed`: its peers are
gone or out of step, and the parent restarts every rank.
"""

from __future__ import annotations

import queue
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minakv.config import EngineConfig
from minakv.gc_pauses import collect_when_due, quiet_gc
from minakv.model import ModelConfig
from minakv.parallel import SINGLE, Parallel
from minakv.worker.transfer import Part, Peer, TransferError

GROUP_TIMEOUT = timedelta(seconds=60)  # a send/recv whose peer hangs (a dead one is torn down at once)


@dataclass
class Ready:
    """The child's first message: the model is loaded and the KV pool is allocated."""

    model_config: ModelConfig
    num_pages: int
    kv_bytes_per_token: int
    max_model_len: int


@dataclass
class Failed:
    """The child's answer when a step (or start-up) raised: the exception, as text."""

    kind: str
    message: str
    trace: str
    fatal: bool = False  # the child exits after it: a transfer or a collective broke

    @classmethod
    def of(cls, exc: BaseException, fatal: bool = False) -> Failed:
        return cls(type(exc).__name__, str(exc), traceback.format_exc(), fatal)


def broken_group(exc: BaseException) -> bool:
    """Did a collective or a transfer fail (a peer died or timed out), rather than the step itself? gloo
    raises a plain RuntimeError naming itself; NCCL a `DistError`."""
    while exc is not None:
        if isinstance(exc, (TransferError, dist.DistError)) or any(
            word in str(exc) for word in ("gloo", "NCCL", "Connection closed by peer", "Connection reset")
        ):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def serve(
    config: EngineConfig,
    results: Connection,
    batches,
    num_threads: int,
    group: str,
    rank: int = 0,
    world: int = 1,
    backend: str = "gloo",
) -> None:
    """The child's main: join the workers' process group, build this rank's share of the model and the
    `Worker` as the in-process engine does, say `Ready`, then serve batches (one worker) or `Part`s (a
    worker of the prefill and decode pools) in order until told to stop (None) or the parent is gone."""
    torch.set_num_threads(num_threads)  # the parent's setting (tests run tiny models on one thread)
    try:
        device = torch.device(config.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend, init_method=group, rank=rank, world_size=world, timeout=GROUP_TIMEOUT
        )
        from minakv.worker.build import load_model_by_name, make_worker  # as the in-process engine builds

        parallel, role_rank = role_parallel(config, rank, world)
        model = load_model_by_name(config, parallel)
        worker, num_pages, per_token, max_model_len = make_worker(config, model)
        stage = backend == "gloo" and device.type == "cuda"
        w = config.world
        peer = None
        if (
            world > w
        ):  # prefill and decode workers: rank i of one trades with rank i of another (its kv heads)
            peer = Peer(worker, rank // w, w, config.page_size, num_pages, stage)
        dist.barrier(device_ids=[device.index or 0] if backend == "nccl" else None)
        results.send((0, Ready(model.config, num_pages, per_token, max_model_len)))
    except BaseException as exc:  # noqa: BLE001 (whatever it is, the parent must hear of it)
        results.send((0, Failed.of(exc)))
        return
    parent = mp.parent_process()
    quiet_gc()  # a collection here stalls the device as in the engine's process (minakv/gc_pauses.py)
    while True:
        try:
            message = batches.get(timeout=1.0)
        except queue.Empty:
            if parent is not None and not parent.is_alive():  # orphaned: nobody will read our results
                break
            collect_when_due(idle=True)
            continue
        if message is None:
            break
        seq, payload = message
        try:
            if isinstance(payload, Part):
                reply = peer.run(payload)
            else:
                reply = worker.collect(worker.launch(payload))
        except Exception as exc:  # noqa: BLE001 (the engine quarantines the step's requests, as in process)
            if world > 1 and broken_group(exc):  # a peer is gone or out of step: this child is done
                results.send((seq, Failed.of(exc, fatal=True)))
                return
            reply = Failed.of(exc)
        results.send((seq, reply if role_rank == 0 or isinstance(reply, Failed) else None))
        collect_when_due(idle=False)
    dist.destroy_process_group()


def role_parallel(config: EngineConfig, rank: int, world: int) -> tuple[Parallel, int]:
    """This rank's place in its worker's model: (its `Parallel`, its rank in the worker). Pools' workers each
    get a subgroup; every process creates every group, in the same order (`new_group` is collective)."""
    w = config.world
    tp, ep = config.tensor_parallel_size, config.expert_parallel_size
    if w == 1:
        return SINGLE, 0
    if world == w:  # one role: the whole group
        return Parallel(rank, tp, ep, expert_dispatch=config.expert_dispatch), rank
    groups = [dist.new_group(list(range(start, start + w))) for start in range(0, world, w)]
    return Parallel(
        rank % w, tp, ep, group=groups[rank // w], expert_dispatch=config.expert_dispatch
    ), rank % w
