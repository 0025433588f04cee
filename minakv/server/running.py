"""Running one request on the engine for an HTTP handler: submit it, wait for its first increment (where
the engine validates), map engine errors to HTTP errors, and abort it if the handler ends early."""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from minakv.engine import CacheOpError, Engine, Overloaded, Unavailable
from minakv.outputs import RequestOutput
from minakv.params import SamplingParams
from minakv.server.cache_ops import CacheOps
from minakv.server.prepare import Tokenized, in_thread, to_tokens
from minakv.server.protocol import PromptTokensDetails, RequestError, UsageInfo, error_body
from minakv.server.shutdown import Cut, cut_at_deadline, refused
from minakv.server.tracking import Trace, traced

FIELD = re.compile(r"^((?:messages|tools)(?:\[\d+\])?(?:\.\w+|\[\d+\])*)")
ENGINE_FAILED = "the engine failed while running this request; see the server log"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_info(out: RequestOutput) -> UsageInfo:
    u = out.usage
    details = PromptTokensDetails(u.cached_tokens, u.repos_tokens, u.drop_skipped_tokens)
    return UsageInfo(u.prompt_tokens, u.completion_tokens, u.prompt_tokens + u.completion_tokens, details)


async def start(
    engine: Engine,
    prompt: Any,
    params: SamplingParams,
    request_id: str,
    ops: CacheOps | None,
    prompt_param: str,
    trace: Trace | None = None,
) -> tuple[AsyncIterator[RequestOutput], RequestOutput]:
    """Submit and wait for the first increment; engine-side validation errors become 400, a full queue 503.
    With a `trace`, the stream reports every increment to it, and closing the stream ends it. The stream
    ends early if the server shuts down (shutdown.py). A text or messages prompt is rendered and tokenized
    by the engine on the event loop: pass its token form (`tokenized`) to keep the loop free."""
    stream = cut_at_deadline(engine.stream(prompt, params, request_id=request_id), engine, request_id)
    if trace is not None:
        stream = traced(stream, trace)
    try:
        first = await stream.__anext__()
    except asyncio.CancelledError:  # the client left while the request waited for its first token
        engine.abort(request_id)
        raise
    except RequestError:  # refused by the shutdown
        raise
    except Overloaded as e:
        raise RequestError(
            f"server overloaded: {e}", status=503, type="server_error", code="overloaded"
        ) from None
    except CacheOpError as e:  # the compiler's messages start with the operation at fault
        text = str(e)
        param = prompt_param
        if ops is not None and text.startswith("drop"):
            param = ops.drop_param
        elif ops is not None and text.startswith("reposition"):
            param = ops.reposition_param
        raise RequestError(f"invalid cache operation: {text}", param) from None
    except ValueError as e:
        raise bad_prompt(e, prompt_param) from None
    # failed before its first token: still a plain HTTP error, streamed or not (the stream is closed first,
    # so its trace ends now rather than whenever the stream is collected)
    if first.finish_reason == "error":
        await stream.aclose()  # type: ignore[attr-defined]
    check_failed(first)
    return stream, first


async def tokenized(engine: Engine, prompt: Any, ops: CacheOps | None, prompt_param: str) -> Tokenized:
    """`prompt` in token form (prepare.py), made in a worker thread; renderer errors name their field."""
    try:
        return await in_thread(to_tokens, engine, prompt, ops, prompt_param)
    except RequestError:
        raise
    except ValueError as e:
        raise bad_prompt(e, prompt_param) from None


def bad_prompt(e: ValueError, default_param: str) -> RequestError:
    """The renderer's errors start with the message or tools entry at fault: use it as the param."""
    match = FIELD.match(str(e))
    return RequestError(str(e), match.group(1) if match else default_param)


async def finish(engine: Engine, stream: AsyncIterator[RequestOutput], request_id: str, done: bool) -> None:
    """Close the engine stream; a request that did not finish is aborted and its pages freed."""
    if not done:
        engine.abort(request_id)
    with contextlib.suppress(RuntimeError, ConnectionError):  # closing twice, or the client is gone
        await stream.aclose()  # type: ignore[attr-defined]


def failure(out: RequestOutput) -> RequestError:
    """Why a request ended with finish reason "error": the shutdown cut it (503), a worker process died (503:
    the engine restarts its workers, try again), or the engine failed (500)."""
    if isinstance(out, Cut):
        return refused()
    if isinstance(out, Unavailable):
        return RequestError(
            f"a worker process failed while running this request: {out.error}",
            status=503,
            type="server_error",
            code="worker_unavailable",
        )
    return RequestError(ENGINE_FAILED, status=500, type="server_error", code="engine_error")


def check_failed(out: RequestOutput) -> None:
    if out.finish_reason == "error":
        raise failure(out)


async def write_stream_error(response: web.StreamResponse, out: RequestOutput | None = None) -> None:
    """A failure after the stream started: an error event (as vLLM and OpenAI send), then the end. `out`
    is the last increment, if known (it tells a shutdown from an engine failure)."""
    err = failure(out) if out is not None else failure(RequestOutput("", []))
    await response.write(b"data: " + error_body(err) + b"\n\n")
    await close_sse(response)


async def close_sse(response: web.StreamResponse) -> None:
    """The end of an event stream: the `[DONE]` sentinel OpenAI clients wait for, then EOF."""
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()


async def open_sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response
