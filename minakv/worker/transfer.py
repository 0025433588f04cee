"""The worker's side of the KV transfer between a prefill and a decode worker process (docs/workers.md).

Each step the parent sends each worker a `Part`: its share of the batch (minakv/worker/split.py) and the
transfers to make first, planned from the coherence table (minakv/worker/coherence.py). The two workers
run the transfers as matched pairs, always in the same order, so neither can wait for the other in vain:

    prefill worker                         decode worker
    send pages (prefill -> decode)  ---->  receive them
    send the step before's samples  ---->  receive them (its first decode inputs reference them)
    receive pages (decode -> prefill) <--  send them
    run its part                           run its part

Pages go layer by layer: the gathered K and V of layer l are on the wire while layer l + 1 is gathered.
A short header comes first: the step's number and, per page, the version the sender holds (each worker
stamps the pages it writes with the versions its parts announce). The receiver checks it against the
versions its own part expects, so a mis-planned or mis-paired transfer fails loudly instead of leaving
stale KV behind. Any failure here is fatal for the pair (`TransferError`): the parent restarts both.

Under tensor / expert parallelism each side is `w` ranks, and prefill rank i pairs with decode rank i
(global ranks i and w + i): each holds the same kv heads, so each pair moves its share of every page, and
the pairs run side by side. Every rank samples, so every prefill rank has the samples its partner needs.
"""

from __future__ import annotations

from dataclasses import dataclass

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
class Part:
    """One worker's share of one step."""

    seq: int
    batch: ForwardBatch | None
    send: Moves | None = None  # pages to send to the peer before the step
    recv: Moves | None = None  # pages to receive from it
    tokens: int = 0  # prefill: send the step before's samples (this many); decode: receive them
    own_last: bool = False  # decode: its own samples of the step before come first (else it had none)
    written: Moves | None = None  # pages this part writes, with their new versions (the stamps)


class Peer:
    """A worker's end of the pair: role, stamps, and the page transfers."""

    def __init__(
        self, worker: Worker, prefill: bool, peer: int, page_size: int, num_pages: int, stage: bool
    ) -> None:
        # under tensor parallelism prefill rank i pairs with decode rank i: each moves its own kv heads
        self.worker, self.prefill, self.peer = worker, prefill, peer
        self.page_size = page_size
        self.stamps = np.zeros(num_pages, dtype=np.int64)  # the version of each page this side holds
        # gloo moves host tensors: two processes on one GPU go through host memory (not fast, but exact)
        self.wire = torch.device("cpu") if stage else worker.device

    def run(self, part: Part) -> StepResult:
        try:
            if self.prefill:
                self._send(part.seq, part.send)
                if part.tokens:
                    self._send_tokens(part.tokens)
                self._recv(part.seq, part.recv)
            else:
                self._recv(part.seq, part.recv)
                if part.tokens or part.batch is not None:
                    self._take_tokens(part)
                self._send(part.seq, part.send)
        except TransferError:
            raise
        except Exception as exc:  # the peer died (gloo: connection closed) or timed out
            raise TransferError(f"KV transfer of step {part.seq} failed: {exc}") from exc
        if part.written is not None:
            self.stamps[part.written.pages] = part.written.versions
        if part.batch is None:
            return StepResult([], [])
        w = self.worker
        return w.collect(w.launch(part.batch))

    def _slots(self, pages: np.ndarray) -> torch.Tensor:
        ps = self.page_size
        slots = (pages[:, None] * ps + np.arange(ps)[None, :]).reshape(-1)
        return torch.from_numpy(slots).to(self.worker.device)

    def _header(self, seq: int, pages: np.ndarray, versions: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.concatenate([[seq, len(pages)], pages, versions]).astype(np.int64))

    @torch.inference_mode()
    def _send(self, seq: int, moves: Moves | None) -> None:
        if moves is None or not len(moves):
            return
        dist.send(self._header(seq, moves.pages, self.stamps[moves.pages]).to(self.wire), self.peer)
        slots, k, v = self._slots(moves.pages), self.worker.k_cache, self.worker.v_cache
        works: list = []
        for layer in range(k.shape[0]):
            buf = torch.stack((k[layer, slots], v[layer, slots])).to(self.wire)
            works.append((dist.isend(buf, self.peer), buf))  # (the buffer lives until its send is done)
            if len(works) > IN_FLIGHT:
                works.pop(0)[0].wait()
        for work, _ in works:
            work.wait()

    @torch.inference_mode()
    def _recv(self, seq: int, moves: Moves | None) -> None:
        if moves is None or not len(moves):
            return
        expected = self._header(seq, moves.pages, moves.versions)
        header = torch.empty_like(expected).to(self.wire)
        dist.recv(header, self.peer)
        if not torch.equal(header.cpu(), expected):
            got = header.cpu().tolist()
            raise TransferError(
                f"step {seq}: expected pages/versions {expected.tolist()[:12]}..., the peer sent {got[:12]}..."
            )
        slots, k, v = self._slots(moves.pages), self.worker.k_cache, self.worker.v_cache
        shape = (2, len(slots), *k.shape[2:])
        bufs = [torch.empty(shape, dtype=k.dtype, device=self.wire) for _ in range(k.shape[0])]
        works = [dist.irecv(buf, self.peer) for buf in bufs]  # all posted: the sender never waits on us
        for layer, (work, buf) in enumerate(zip(works, bufs)):
            work.wait()
            buf = buf.to(k.device, non_blocking=True)
            k[layer, slots] = buf[0]
            v[layer, slots] = buf[1]
        self.stamps[moves.pages] = moves.versions

    def _send_tokens(self, n: int) -> None:
        last = self.worker.last_tokens
        if last.numel() != n:
            raise TransferError(
                f"the decode worker expects {n} samples of the step before; there are {last.numel()}"
            )
        dist.send(last.to(self.wire), self.peer)

    def _take_tokens(self, part: Part) -> None:
        """The decode worker's view of the step before's samples: its own rows, then the prefill worker's
        (the batch's sample order), so `-(j + 1)` inputs resolve as they do in one worker."""
        w = self.worker
        own = w.last_tokens if part.own_last else w.last_tokens[:0]
        if part.tokens:
            theirs = torch.empty(part.tokens, dtype=torch.int64, device=self.wire)
            dist.recv(theirs, self.peer)
            own = torch.cat([own, theirs.to(w.device)])
        w.last_tokens = own
