"""The worker's side of the KV transfers between the workers of the prefill and decode pools (docs/workers.md).

Each step the parent sends each worker a `Part`: its share of the batch (minakv/worker/split.py,
placement.py) and the transfers it takes part in, planned from the coherence table
(minakv/worker/coherence.py). A `Transfer` goes from one worker to another: KV pages, then the samples of
the step before (a request whose prompt ended on a prefill worker decodes now from that token, which is
still there). The workers are numbered (prefill 0..N-1, then decode N..N+M-1) and every step's transfers
run in one global order, by (source, destination), which each worker follows for the ones it is in:

    transfers of step N    (0 -> 2)   (0 -> 3)   (1 -> 2)   (3 -> 0)
    prefill worker 0        send       send                  receive
    prefill worker 1                              send
    decode worker 2         receive               receive
    decode worker 3                    receive               send

Sends and receives block, yet this cannot deadlock: the first unfinished transfer in the global order is
the next one of both its ends (each has finished every earlier one it was in), so it always proceeds.

Pages go layer by layer: the gathered K and V of layer l are on the wire while layer l + 1 is gathered.
A short header comes first: the step's number and, per page, the version the sender holds (each worker
stamps the pages it writes with the versions its parts announce). The receiver checks it against the
versions its own part expects, so a mis-planned or mis-paired transfer fails loudly instead of leaving
stale KV behind. Any failure here is fatal (`TransferError`): the parent restarts every worker.

Under tensor / expert parallelism each worker is `w` ranks, and rank i of one trades with rank i of another
(global ranks worker * w + i): they hold the same kv heads, so each moves its share of every page, and the
w planes run side by side. Every rank samples, so every rank has the samples its partner needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from minakv.worker.batch import ForwardBatch
from minakv.worker.coherence import Moves
from minakv.worker.worker import StepResult, Worker

IN_FLIGHT = 2  # layers on the wire at once: enough to overlap the gather with the send, little memory


class TransferError(RuntimeError):
    """A transfer between the workers failed (the peer died, or the header did not match)."""


@dataclass
class Transfer:
    """What one worker sends another before a step: KV pages, then its samples of the step before."""

    src: int
    dst: int
    pages: Moves | None = None
    samples: int = 0


@dataclass
class Part:
    """One worker's share of one step."""

    seq: int
    batch: ForwardBatch | None
    transfers: list[Transfer] = field(default_factory=list)  # the ones it is in, in the step's global order
    # the step before's samples its inputs reference (-(j + 1): row j of this list's concatenation), as
    # (worker, count) in order; its own samples are its `last_tokens`, the others' arrive in `transfers`
    view: list[tuple[int, int]] = field(default_factory=list)
    written: Moves | None = None  # pages this part writes, with their new versions (the stamps)


class Peer:
    """A worker's end of the transfers: its number, its stamps, and the page and sample transfers."""

    def __init__(
        self, worker: Worker, me: int, ranks: int, page_size: int, num_pages: int, stage: bool
    ) -> None:
        self.worker, self.me = worker, me
        self.rank = dist.get_rank() % ranks  # this rank's plane: it trades with rank `rank` of the others
        self.ranks = ranks
        self.page_size = page_size
        self.stamps = np.zeros(num_pages, dtype=np.int64)  # the version of each page this worker holds
        # gloo moves host tensors: two processes on one GPU go through host memory (not fast, but exact)
        self.wire = torch.device("cpu") if stage else worker.device

    def run(self, part: Part) -> StepResult:
        received: dict[int, torch.Tensor] = {}
        try:
            for t in part.transfers:
                if t.src == self.me:
                    self._send(part.seq, t.pages, self._global(t.dst))
                    if t.samples:
                        self._send_samples(t.samples, self._global(t.dst))
                elif t.dst == self.me:
                    self._recv(part.seq, t.pages, self._global(t.src))
                    if t.samples:
                        received[t.src] = self._recv_samples(t.samples, self._global(t.src))
        except TransferError:
            raise
        except Exception as exc:  # the peer died (gloo: connection closed) or timed out
            raise TransferError(f"KV transfer of step {part.seq} failed: {exc}") from exc
        if part.view:
            self._take_samples(part.view, received)
        if part.written is not None:
            self.stamps[part.written.pages] = part.written.versions
        if part.batch is None:
            return StepResult([], [])
        w = self.worker
        return w.collect(w.launch(part.batch))

    def _global(self, worker: int) -> int:
        return worker * self.ranks + self.rank

    def _slots(self, pages: np.ndarray) -> torch.Tensor:
        ps = self.page_size
        slots = (pages[:, None] * ps + np.arange(ps)[None, :]).reshape(-1)
        return torch.from_numpy(slots).to(self.worker.device)

    def _header(self, seq: int, pages: np.ndarray, versions: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.concatenate([[seq, len(pages)], pages, versions]).astype(np.int64))

    @torch.inference_mode()
    def _send(self, seq: int, moves: Moves | None, peer: int) -> None:
        if moves is None or not len(moves):
            return
        dist.send(self._header(seq, moves.pages, self.stamps[moves.pages]).to(self.wire), peer)
        slots, k, v = self._slots(moves.pages), self.worker.k_cache, self.worker.v_cache
        works: list = []
        for layer in range(k.shape[0]):
            buf = torch.stack((k[layer, slots], v[layer, slots])).to(self.wire)
            works.append((dist.isend(buf, peer), buf))  # (the buffer lives until its send is done)
            if len(works) > IN_FLIGHT:
                works.pop(0)[0].wait()
        for work, _ in works:
            work.wait()

    @torch.inference_mode()
    def _recv(self, seq: int, moves: Moves | None, peer: int) -> None:
        if moves is None or not len(moves):
            return
        expected = self._header(seq, moves.pages, moves.versions)
        header = torch.empty_like(expected).to(self.wire)
        dist.recv(header, peer)
        if not torch.equal(header.cpu(), expected):
            got = header.cpu().tolist()
            raise TransferError(
                f"step {seq}: expected pages/versions {expected.tolist()[:12]}..., the peer sent {got[:12]}..."
            )
        slots, k, v = self._slots(moves.pages), self.worker.k_cache, self.worker.v_cache
        shape = (2, len(slots), *k.shape[2:])
        bufs = [torch.empty(shape, dtype=k.dtype, device=self.wire) for _ in range(k.shape[0])]
        works = [dist.irecv(buf, peer) for buf in bufs]  # all posted: the sender never waits on us
        for layer, (work, buf) in enumerate(zip(works, bufs)):
            work.wait()
            buf = buf.to(k.device, non_blocking=True)
            k[layer, slots] = buf[0]
            v[layer, slots] = buf[1]
        self.stamps[moves.pages] = moves.versions

    def _send_samples(self, n: int, peer: int) -> None:
        last = self.worker.last_tokens
        if last.numel() != n:
            raise TransferError(f"a peer expects {n} samples of the step before; there are {last.numel()}")
        dist.send(last.to(self.wire), peer)

    def _recv_samples(self, n: int, peer: int) -> torch.Tensor:
        theirs = torch.empty(n, dtype=torch.int64, device=self.wire)
        dist.recv(theirs, peer)
        return theirs.to(self.worker.device)

    def _take_samples(self, view: list[tuple[int, int]], received: dict[int, torch.Tensor]) -> None:
        """This worker's view of the step before's samples: the listed workers' rows, in order (its own are
        its `last_tokens`), which the parent renumbered its `-(j + 1)` inputs against."""
        w = self.worker
        rows = []
        for worker, n in view:
            rows.append(w.last_tokens if worker == self.me else received[worker])
            if len(rows[-1]) != n:
                raise TransferError(f"expected {n} samples of the step before from worker {worker}")
        w.last_tokens = torch.cat(rows)
