"""Following one request from arrival to its end: the timings and token counts for the metrics, and one
log line per finished request.

The server sees a request only through its engine stream, so `traced` wraps that stream: every increment
passes through `Trace.see`, and closing the stream (the handler's `finish`, or the stream breaking off
because the client left) ends the trace. All times are the server's: arrival is when the handler started,
the first token when the first increment with tokens came out of the engine, so TTFT is what a client sees,
less the network. The time a request waited before the scheduler admitted it is not here: only the
engine knows when that happened, and it does not report it.

The log line names the request and its numbers, never the prompt, unless the server runs with
--log-prompts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from minakv.outputs import RequestOutput, Usage
from minakv.server.metrics import Finished, ServerMetrics

log = logging.getLogger("minakv.server.requests")


class Trace:
    def __init__(self, request_id: str, arrival: float, metrics: ServerMetrics, prompt: Any = None) -> None:
        self.request_id = request_id
        self.arrival = arrival  # time.monotonic() when the handler started
        self.metrics = metrics
        self.prompt = prompt  # None unless prompts are logged
        self.first_token: float | None = None
        self.last: RequestOutput | None = None
        self.tokens = 0  # generated tokens seen so far
        self.rejected = False  # the engine refused the request: it never ran, so it is not counted
        self.ended = False

    def see(self, out: RequestOutput) -> None:
        if out.token_ids and self.first_token is None:
            self.first_token = time.monotonic()
        self.tokens += len(out.token_ids)
        self.last = out

    def end(self) -> None:
        if self.ended or self.rejected:
            return
        self.ended = True
        last, now = self.last, time.monotonic()
        usage = last.usage if last is not None else Usage()
        # the engine fills in usage's prompt and completion counts when it finishes a request; one that
        # ended early (the client left) has only the tokens seen
        finished = last is not None and last.finished
        done = Finished(
            request_id=self.request_id,
            finish_reason=last.finish_reason if last is not None and last.finish_reason else "abort",
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
            repos_tokens=usage.repos_tokens,
            drop_skipped_tokens=usage.drop_skipped_tokens,
            completion_tokens=usage.completion_tokens if finished else self.tokens,
            ttft=self.first_token - self.arrival if self.first_token is not None else None,
            duration=now - self.arrival,
            prompt=self.prompt,
        )
        self.metrics.observe(done)
        log_finished(done)


def log_finished(done: Finished) -> None:
    fields: dict[str, Any] = {
        "reason": done.finish_reason,
        "prompt_tokens": done.prompt_tokens,
        "cached_tokens": done.cached_tokens,
        "completion_tokens": done.completion_tokens,
        "repos_tokens": done.repos_tokens,
        "drop_skipped_tokens": done.drop_skipped_tokens,
        "ttft": f"{done.ttft:.3f}s" if done.ttft is not None else "-",
        "duration": f"{done.duration:.3f}s",
    }
    if done.prompt is not None:
        fields["prompt"] = json.dumps(done.prompt, ensure_ascii=False, default=str)
    log.info("finished %s %s", done.request_id, " ".join(f"{k}={v}" for k, v in fields.items()))


async def traced(stream: AsyncIterator[RequestOutput], trace: Trace) -> AsyncIterator[RequestOutput]:
    """`stream` with every increment shown to `trace`; closing it closes `stream` and ends the trace."""
    try:
        async for out in stream:
            trace.see(out)
            yield out
    except Exception:
        # before any increment: the engine refused the request (a bad prompt, a full queue), it never ran
        trace.rejected = trace.last is None
        raise
    finally:
        with contextlib.suppress(RuntimeError):  # closing twice
            await stream.aclose()  # type: ignore[attr-defined]
        trace.end()
