"""The worker process's main: join the workers' process group, build the model and the `Worker`, serve.

The parent (minakv/worker/process.py) spawns it and reads its answers: first `Ready` (or `Failed`: a bad
model name, say), then one result per step, in order. A step is a `ForwardBatch` for a worker doing both
prefill and decode, or a `Part` for one of a prefill/decode pair (minakv/worker/transfer.py). A step that
raises is answered `Failed` and the child goes on (the engine quarantines the step's requests); a broken
transfer ends the child, since its peer is gone or out of step and the parent restarts the pair.
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
from minakv.model import ModelConfig
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

    @classmethod
    def of(cls, exc: BaseException) -> Failed:
        return cls(type(exc).__name__, str(exc), traceback.format_exc())


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
    """The child's main: join the workers' process group, build the model and the `Worker` as the in-process
    engine does, say `Ready`, then serve batches (one worker) or `Part`s (a prefill/decode pair) in order
    until told to stop (None) or the parent is gone. A broken transfer ends the child: the pair is lost."""
    torch.set_num_threads(num_threads)  # the parent's setting (tests run tiny models on one thread)
    try:
        device = torch.device(config.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend, init_method=group, rank=rank, world_size=world, timeout=GROUP_TIMEOUT
        )
        from minakv.engine import load_model_by_name, make_worker  # the engine's own code, not a copy

        model = load_model_by_name(config)
        worker, num_pages, per_token, max_model_len = make_worker(config, model)
        stage = backend == "gloo" and device.type == "cuda"
        peer = Peer(worker, rank, config.page_size, num_pages, stage) if world > 1 else None
        dist.barrier(device_ids=[device.index or 0] if backend == "nccl" else None)
        results.send((0, Ready(model.config, num_pages, per_token, max_model_len)))
    except BaseException as exc:  # noqa: BLE001 (whatever it is, the parent must hear of it)
        results.send((0, Failed.of(exc)))
        return
    parent = mp.parent_process()
    while True:
        try:
            message = batches.get(timeout=1.0)
        except queue.Empty:
            if parent is not None and not parent.is_alive():  # orphaned: nobody will read our results
                break
            continue
        if message is None:
            break
        seq, payload = message
        try:
            if isinstance(payload, Part):
                reply = peer.run(payload)
            else:
                reply = worker.collect(worker.launch(payload))
        except TransferError as exc:  # the peer is gone or out of step: nothing more this child can do
            results.send((seq, Failed.of(exc)))
            return
        except Exception as exc:  # noqa: BLE001 (the engine quarantines the step's requests, as in process)
            reply = Failed.of(exc)
        results.send((seq, reply))
    dist.destroy_process_group()
