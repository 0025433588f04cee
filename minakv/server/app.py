"""The aiohttp application: routes, authentication, errors, streaming.

Every request is decoded into a typed struct (protocol.py), turned into an engine prompt and sampling
parameters (prompts.py), and handed to `engine.stream`, an async generator of increments (running.py).
The engine validates the prompt on the first increment, so nothing is sent to the client before that: a
bad prompt still gets a clean HTTP 400, and a full waiting queue a 503. A streamed response is Server-Sent Events in
OpenAI's chunk format. If the client goes away, aiohttp cancels the handler (`handler_cancellation`) or the
next write fails; either way the `finally` aborts the request so its pages return to the pool.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

from minakv.engine import Engine
from minakv.server import anthropic, output, prompts
from minakv.server.cache_ops import has_cache_ops
from minakv.server.metrics import CONTENT_TYPE, ServerMetrics
from minakv.server.protocol import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Delta,
    ModelCard,
    ModelList,
    RequestError,
    UsageInfo,
    decode_request,
    error_body,
)
from minakv.server.responses_route import create_response
from minakv.server.running import (
    bad_prompt,
    check_failed,
    close_sse,
    finish,
    new_id,
    open_sse,
    start,
    usage_info,
    write_stream_error,
)
from minakv.server.tracking import Trace

ENGINE = web.AppKey("engine", Engine)
SETTINGS = web.AppKey("settings", dict)
METRICS = web.AppKey("metrics", ServerMetrics)
JSON = "application/json"
log = logging.getLogger("minakv.server")


def make_app(
    engine: Engine,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_body_bytes: int = 32 << 20,
    log_prompts: bool = False,
) -> web.Application:
    """The server for `engine`. `served_model_name` is the name clients must send as `model` (the model
    argument is accepted too); with `api_key`, /v1 routes need `Authorization: Bearer <api_key>`; with
    `log_prompts`, each request's log line carries its prompt."""
    app = web.Application(client_max_size=max_body_bytes, middlewares=[errors_and_auth])
    names = [served_model_name or engine.model_name]
    app[ENGINE] = engine
    app[SETTINGS] = {"names": names, "accepted": {*names, engine.model_name}, "api_key": api_key,
                     "log_prompts": log_prompts}  # fmt: skip
    app[METRICS] = ServerMetrics(engine, names[0])
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/responses", create_response)  # OpenAI Responses API (responses_route.py)
    app.router.add_post("/v1/messages", anthropic.messages)  # Anthropic Messages API
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


def new_trace(request: web.Request, request_id: str, arrival: float, prompt: object) -> Trace:
    """The metrics and the log line of one request; the prompt is kept only to be logged."""
    logged = prompt if request.app[SETTINGS]["log_prompts"] else None
    return Trace(request_id, arrival, request.app[METRICS], logged)


def error_response(err: RequestError) -> web.Response:
    return web.Response(status=err.status, body=error_body(err), content_type=JSON)


@web.middleware
async def errors_and_auth(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """API-key check for /v1 routes, and every failure as an OpenAI-style JSON error body."""
    try:
        key = request.app[SETTINGS]["api_key"]
        if key is not None and request.path.startswith("/v1/"):
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                what = "Missing" if not given else "Incorrect"
                raise RequestError(
                    f"{what} API key: send 'Authorization: Bearer <key>'", status=401, code="invalid_api_key"
                )
        response = await handler(request)
    except RequestError as e:
        response = error_response(e)
    except web.HTTPRequestEntityTooLarge as e:
        response = error_response(RequestError(f"request body too large: {e.text}", status=413))
    except web.HTTPException as e:  # unknown route, wrong method
        response = error_response(RequestError(e.reason, status=e.status))
    except (ConnectionError, asyncio.CancelledError):
        raise  # the client is gone; nothing to answer
    except Exception as e:  # a bug: answer 500 in the usual shape, keep serving
        log.exception("error while handling %s", request.path)
        response = error_response(RequestError(f"internal error: {e!r}", status=500, type="server_error"))
    info = request.match_info.route.resource
    request.app[METRICS].count_response(info.canonical if info is not None else "other", response.status)
    return response


# ---------------------------------------------------------------------------------------------------------
# /v1/chat/completions


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    engine, settings = request.app[ENGINE], request.app[SETTINGS]
    body = await request.read()
    req: ChatCompletionRequest = decode_request(body, ChatCompletionRequest)
    prompts.check_common(req, settings["accepted"])
    logprobs = prompts.chat_logprobs(req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise RequestError(f"{param_name} must be a positive integer, got {max_tokens}", param_name)
    params = prompts.sampling_params(req, max_tokens or engine.max_model_len, logprobs)
    prompt, ops, tools_on = prompts.chat_prompt(req, msgspec.json.decode(body))
    tools = prompt.get("tools") if tools_on else None
    parser = output.ChatParser(engine.arch, engine.tokenizer, tools)
    if ops is not None and ops.thinking_drop:
        try:
            prompt = prompts.thinking_drop_prompt(engine.tokenizer, prompt, ops)
        except RequestError:
            raise
        except ValueError as e:
            raise bad_prompt(e, "messages") from None
    rid, created, model = new_id("chatcmpl"), int(time.time()), settings["names"][0]
    trace = new_trace(request, rid, arrival, prompt)
    stream, first = await start(engine, prompt, params, rid, ops, "messages", trace)
    with_usage = has_cache_ops(req) or bool(req.stream_options and req.stream_options.include_usage)
    done = False
    try:
        if not req.stream:
            last = first
            parser.step(first)
            while not last.finished:
                last = await stream.__anext__()
                parser.step(last)
            done = True
            check_failed(last)
            message, finish_reason = parser.message(last.finish_reason)
            choice = ChatChoice(0, message, finish_reason, parser.logprobs_all())
            body = ChatCompletion(rid, created, model, [choice], usage_info(last))
            return web.Response(body=msgspec.json.encode(body), content_type=JSON)

        response = await open_sse(request)

        async def send(choices: list[ChunkChoice], usage: UsageInfo | None = None) -> None:
            chunk = ChatCompletionChunk(rid, created, model, choices, usage)
            await response.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")

        await send([ChunkChoice(0, Delta(role="assistant", content=""))])
        out = first
        while True:
            for delta, lps in parser.deltas(out):
                await send([ChunkChoice(0, delta, None, lps)])
            if out.finished:
                break
            out = await stream.__anext__()
        done = True
        if out.finish_reason == "error":
            await write_stream_error(response)
            return response
        await send([ChunkChoice(0, Delta(), parser.finish_reason(out.finish_reason))])
        if with_usage:
            await send([], usage_info(out))
        await close_sse(response)
        return response
    finally:
        await finish(engine, stream, rid, done)


# ---------------------------------------------------------------------------------------------------------
# /v1/completions


async def completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    engine, settings = request.app[ENGINE], request.app[SETTINGS]
    req: CompletionRequest = decode_request(await request.read(), CompletionRequest)
    prompts.check_common(req, settings["accepted"])
    prompts.check_completion(req)
    prompt = prompts.completion_prompt(req)
    params = prompts.sampling_params(req, req.max_tokens if req.max_tokens is not None else 16, req.logprobs)
    rid, created, model = new_id("cmpl"), int(time.time()), settings["names"][0]
    trace = new_trace(request, rid, arrival, prompt)
    stream, first = await start(engine, prompt, params, rid, None, "prompt", trace)
    lps = output.CompletionLogprobsBuilder(engine) if req.logprobs is not None else None
    done = False
    try:
        if not req.stream:
            outs = [first]
            while not outs[-1].finished:
                outs.append(await stream.__anext__())
            done = True
            check_failed(outs[-1])
            text = "".join(o.text for o in outs)
            for o in outs:
                if lps is not None:
                    lps.add(o)
            choice = CompletionChoice(0, text, outs[-1].finish_reason, lps.build() if lps else None)
            body = Completion(rid, created, model, [choice], usage_info(outs[-1]))
            return web.Response(body=msgspec.json.encode(body), content_type=JSON)

        response = await open_sse(request)
        out = first
        while True:
            chunk_lps = None
            if lps is not None:
                chunk_lps = output.CompletionLogprobsBuilder(engine, lps.offset).add(out).build()
                lps.add(out)
            if out.text or out.finished or chunk_lps is not None:
                choice = CompletionChoice(0, out.text, out.finish_reason, chunk_lps)
                await response.write(
                    b"data: " + msgspec.json.encode(Completion(rid, created, model, [choice])) + b"\n\n"
                )
            if out.finished:
                break
            out = await stream.__anext__()
        done = True
        if out.finish_reason == "error":
            await write_stream_error(response)
            return response
        if req.stream_options and req.stream_options.include_usage:
            chunk = Completion(rid, created, model, [], usage_info(out))
            await response.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
        await close_sse(response)
        return response
    finally:
        await finish(engine, stream, rid, done)


# ---------------------------------------------------------------------------------------------------------
# models, health, metrics


async def models(request: web.Request) -> web.Response:
    engine, settings = request.app[ENGINE], request.app[SETTINGS]
    cards = [ModelCard(name, int(time.time()), engine.max_model_len) for name in settings["names"]]
    return web.Response(body=msgspec.json.encode(ModelList(cards)), content_type=JSON)


async def health(request: web.Request) -> web.Response:
    return web.Response(body=b'{"status":"ok"}', content_type=JSON)


async def metrics(request: web.Request) -> web.Response:
    body = await asyncio.to_thread(request.app[METRICS].render)  # engine.stats() may wait for a step
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})
