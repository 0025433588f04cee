"""The hand-off between the threads that use an `Engine` and the engine's own thread.

Callers never touch the scheduler. They post new requests and aborts here, under one lock, and wake the
engine thread; the engine thread takes them at the top of its loop, and after each step posts each
request's news back to the event loop of the stream that waits for it, one callback per loop per step:

    callers (event loops, threads)                 engine thread
    submit(request, queue)  --- inbox ------------> take() -> scheduler.add
    abort(id), close(...)   --- aborts -----------> take() -> scheduler.abort
    await queue.get()       <-- call_soon_threadsafe --- deliver(changed requests)
"""

from __future__ import annotations

import asyncio
import threading

from minakv.outputs import RequestOutput
from minakv.scheduler.request import Request


class Overloaded(RuntimeError):
    """The waiting queue is full; try again later (the server answers 503)."""


class Mailbox:
    def __init__(self) -> None:
        self.lock = threading.Lock()  # guards the inbox, the aborts, the stream table and `closing`
        self.wake = threading.Event()  # set when there is something for the engine thread
        self.closing = False  # shutdown began (or the workers could not restart): no new requests
        self._inbox: list[Request] = []
        self._aborts: list[str] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}

    def submit(self, request: Request, queue: asyncio.Queue, waiting: int, max_waiting: int) -> None:
        """Queue a request whose increments go to `queue` on the running event loop; `waiting`: how many the
        scheduler already has waiting. Raises Overloaded when closing or past `max_waiting`."""
        with self.lock:
            if self.closing:
                raise Overloaded("the engine is shutting down")
            if len(self._inbox) + waiting >= max_waiting:
                raise Overloaded(f"{max_waiting} requests are already waiting")
            self._streams[request.request_id] = (asyncio.get_running_loop(), queue)
            self._inbox.append(request)
        self.wake.set()

    def close_stream(self, request: Request) -> None:
        """The stream's consumer finished or went away (a client disconnected): abort it if unfinished."""
        with self.lock:
            if self._streams.pop(request.request_id, None) is not None and request.finish_reason is None:
                self._aborts.append(request.request_id)
        self.wake.set()

    def abort(self, request_id: str) -> None:
        with self.lock:
            self._aborts.append(request_id)
        self.wake.set()

    def take(self) -> tuple[list[Request], list[str]]:
        """The new requests and the aborts posted since the last take."""
        with self.lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        return inbox, aborts

    def close(self) -> None:
        with self.lock:
            self.closing = True

    def has_inbox(self) -> bool:
        with self.lock:
            return bool(self._inbox)

    def deliver(self, changed: list[Request]) -> None:
        """Hand each changed request's news to its stream, on the stream's own event loop: one callback per
        loop per step, whatever the batch (a callback per stream would wake the loop through its self-pipe
        hundreds of times a step, and the loop's thread would hold the GIL the engine thread needs)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        with self.lock:
            targets = [(r, self._streams.get(r.request_id)) for r in changed]
        for r, target in targets:
            if target is None:
                continue
            loop, queue = target
            out = r.output(incremental=True)
            if out.token_ids or out.text or out.finish_reason is not None:
                batches.setdefault(loop, []).append((queue, out))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed: its callers are gone
                pass


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)
