"""Graceful shutdown: on SIGTERM, finish what is running, refuse what is new, end the rest cleanly, exit 0.

The sequence (`serve`):

1. SIGTERM (or SIGINT) flips the app's `Drain` to not accepting: from then on every new request gets a 503
   in the usual error shape (`/metrics` stays open, so the drain can be watched), while the listening
   socket stays open, so a client is told why instead of finding the port closed.
2. The requests in flight (counted by the `draining` middleware) get up to `--shutdown-timeout` seconds
   to finish.
3. Past that, the rest are cut: each engine stream still open is aborted, and its last increment becomes a
   `Cut` (finish reason "error"), which the handlers already know how to end: a streamed response gets a
   final error event and `data: [DONE]`, an unstreamed one a 503.
4. The HTTP side is closed (aiohttp cancels anything still left after a short wait), and the engine is
   given a moment to become idle, so that its background thread is waiting, not inside a torch call,
   when the interpreter exits.

Why 4 matters: the engine's step loop runs in a daemon thread. At interpreter exit a daemon thread that is
inside native code (a torch op) when the runtime tears down dies with std::terminate, the SIGABRT seen
before; one that sleeps on its wake-up event exits quietly.

How a handler finds the drain: the middleware puts it in a context variable (`DRAIN`) for the request's
task, and `running.start` wraps every engine stream with `cut_at_deadline`, so every route that starts its
engine request through `running.start` is drained the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator
from contextvars import ContextVar
from dataclasses import dataclass

from aiohttp import web

from minakv.engine import Engine
from minakv.outputs import RequestOutput
from minakv.server.errors import Handler, Runner
from minakv.server.protocol import RequestError

log = logging.getLogger("minakv.server")
SHUTTING_DOWN = "the server is shutting down"


class Drain:
    """The app's shutdown state: whether new requests are taken, how many run, which streams to cut."""

    def __init__(self) -> None:
        self.accepting = True
        self.cut = False  # past the deadline: end every stream now
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.streams: dict[str, Engine] = {}  # request id -> its engine, while its stream is open

    def cut_all(self) -> None:
        self.cut = True
        for request_id, engine in list(self.streams.items()):
            engine.abort(request_id)  # the engine answers with a last "abort" increment: cut_at_deadline


DRAIN_KEY = web.AppKey("drain", Drain)
DRAIN: ContextVar[Drain | None] = ContextVar("minakv_drain", default=None)


def refused() -> RequestError:
    return RequestError(SHUTTING_DOWN, status=503, type="server_error", code="server_shutting_down")


@web.middleware
async def draining(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse new requests once draining; count the ones in flight; publish the drain to the handler."""
    drain = request.app[DRAIN_KEY]
    if not drain.accepting and request.path != "/metrics":
        raise refused()
    drain.inflight += 1
    drain.idle.clear()
    DRAIN.set(drain)  # the request's own task: the variable is seen by this request only
    try:
        return await handler(request)
    finally:
        drain.inflight -= 1
        if drain.inflight == 0:
            drain.idle.set()


@dataclass
class Cut(RequestOutput):
    """The last increment of a request ended by the shutdown (finish reason "error")."""


async def cut_at_deadline(
    stream: AsyncIterator[RequestOutput], engine: Engine, request_id: str
) -> AsyncIterator[RequestOutput]:
    """`stream`, ended by a `Cut` when the drain's deadline passes. Costs nothing per increment: the drain
    aborts the request in the engine, and the engine's own last increment ("abort") becomes the Cut."""
    drain = DRAIN.get()
    if drain is None:  # not under the middleware (a test calling start directly)
        async for out in stream:
            yield out
        return
    if drain.cut:
        raise refused()
    drain.streams[request_id] = engine
    try:
        async for out in stream:
            if drain.cut and out.finish_reason == "abort":
                yield Cut(out.request_id, [], finish_reason="error", usage=out.usage)
                return
            yield out
    finally:
        drain.streams.pop(request_id, None)
        with contextlib.suppress(RuntimeError):  # closing twice
            await stream.aclose()  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------------------
# Running the server until a signal, then draining


async def serve(app: web.Application, engine: Engine, host: str, port: int, timeout: float) -> None:
    """Serve `app` until SIGTERM or SIGINT, then drain (see the module docstring) and return."""
    runner = Runner(app, handler_cancellation=True, shutdown_timeout=2.0)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    drain, stop = app[DRAIN_KEY], asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():  # a second signal: do not wait for the timeout
            drain.cut_all()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, on_signal)
    await stop.wait()

    drain.accepting = False
    log.info("shutting down: %d requests in flight, waiting up to %.0f s for them", drain.inflight, timeout)
    if not await wait_for(drain.idle, timeout):
        log.info("shutting down: ending %d requests that did not finish in time", drain.inflight)
        drain.cut_all()
        await wait_for(drain.idle, 10.0)  # handlers write their last event; aborts land at the next step
    await runner.cleanup()  # closes the sockets; cancels handlers still running after shutdown_timeout
    # the engine ends what is left and stops its thread, so the process exits with nothing inside torch
    await asyncio.to_thread(engine.shutdown, 10.0)
    log.info("shut down")


async def wait_for(event: asyncio.Event, timeout: float) -> bool:
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except asyncio.TimeoutError:
        return False
    return True
