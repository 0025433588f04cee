"""The aiohttp application: routes and streaming (errors: errors.py, the API key: auth.py, shutdown:
shutdown.py, limits: limits.py).

Every request is decoded into a typed struct (protocol.py), checked against the limits, turned into an
engine prompt and sampling parameters (prompts.py), rendered and tokenized in a worker thread (prepare.py),
and handed to `engine.stream`, an async generator of increments (running.py). The engine validates the
prompt on the first increment, so nothing is sent to the client before that: a bad prompt still gets a
clean HTTP 400, and a full waiting queue a 503. A streamed response is Server-Sent Events in
OpenAI's chunk format. If the client goes away, aiohttp cancels the handler (`handler_cancellation`) or the
next write fails; either way the `finally` aborts the request so its pages return to the pool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import msgspec
from aiohttp import web

from minakv.engine import Engine
from minakv.outputs import RequestOutput
from minakv.server import anthropic, limits, output, prepare, prompts, structured
from minakv.server.auth import require_key
from minakv.server.cache_ops import has_cache_ops
from minakv.server.choices import finish_choices, merged, start_choices, total_usage
from minakv.server.errors import SSE_STREAM, Handler, errors
from minakv.server.limits import DEFAULT_LIMITS, Limits
from minakv.server.metrics import CONTENT_TYPE, ServerMetrics
from minakv.server.openapi import openapi_document
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
    UsageInfo,
)
from minakv.server.responses_route import create_response
from minakv.server.running import (
    check_failed,
    close_sse,
    new_id,
    open_sse,
    tokenized,
    usage_info,
    write_stream_error,
)
from minakv.server.shutdown import DRAIN_KEY, Drain, draining
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
    max_body_bytes: int | None = None,
    log_prompts: bool = False,
    limits: Limits = DEFAULT_LIMITS,
) -> web.Application:
    """The server for `engine`. `served_model_name` is the name clients must send as `model` (the model
    argument is accepted too); with `api_key`, /v1 routes need `Authorization: Bearer <api_key>`; with
    `log_prompts`, each request's log line carries its prompt; `limits` bound what one request may ask
    for (limits.py; `max_body_bytes`, if given, replaces its body size)."""
    if max_body_bytes is not None:
        limits = dataclasses.replace(limits, max_body_bytes=max_body_bytes)
    # outermost first: every response is counted, every error reshaped, then draining and the key
    middlewares = [count_responses, errors, draining] + (
        [require_key(api_key)] if api_key is not None else []
    )
    app = web.Application(client_max_size=limits.max_body_bytes, middlewares=middlewares)
    names = [served_model_name or engine.model_name]
    app[ENGINE] = engine
    app[SETTINGS] = {"names": names, "accepted": {*names, engine.model_name}, "api_key": api_key,
                     "log_prompts": log_prompts, "limits": limits}  # fmt: skip
    app[METRICS] = ServerMetrics(engine, names[0])
    app[DRAIN_KEY] = Drain()
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/responses", create_response)  # OpenAI Responses API (responses_route.py)
    app.router.add_post("/v1/messages", anthropic.messages)  # Anthropic Messages API
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    return app


def new_trace(request: web.Request, request_id: str, arrival: float, prompt: object) -> Trace:
    """The metrics and the log line of one request; the prompt is kept only to be logged."""
    logged = prompt if request.app[SETTINGS]["log_prompts"] else None
    return Trace(request_id, arrival, request.app[METRICS], logged)


@web.middleware
async def count_responses(request: web.Request, handler: Handler) -> web.StreamResponse:
    """`minakv_http_responses_total{route,status}`; errors arrive here already as responses."""
    response = await handler(request)
    info = request.match_info.route.resource
    request.app[METRICS].count_response(info.canonical if info is not None else "other", response.status)
    return response


# ---------------------------------------------------------------------------------------------------------
# /v1/chat/completions


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    engine, settings = request.app[ENGINE], request.app[SETTINGS]
    req, raw = await prepare.decode(await request.read(), ChatCompletionRequest, raw=True)
    # the cheap checks first: counts and sampling settings, before anything is rendered
    prompts.check_common(req, settings["accepted"])
    limits.check_chat(req, settings["limits"])
    logprobs = prompts.chat_logprobs(req)
    params = prompts.sampling_params(req, 1, logprobs, settings["limits"])
    prompt, ops, tools_on = prompts.chat_prompt(req, raw, structured=True)
    params.grammar = structured.chat_grammar(req, raw, tools_on, engine.arch, engine.tokenizer)
    tokens = await tokenized(engine, prompt, ops, "messages")
    await structured.compile_off_loop(engine, params.grammar, structured.grammar_param(req))
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    wanted = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params.max_tokens = limits.max_tokens(
        wanted, param, tokens.next_pos, engine.max_model_len, None, "messages"
    )
    tools = prompt.get("tools") if tools_on else None
    parsers = [output.ChatParser(engine.arch, engine.tokenizer, tools) for _ in range(req.n)]
    rid, created, model = new_id("chatcmpl"), int(time.time()), settings["names"][0]
    trace = new_trace(request, rid, arrival, prompt)
    choices = await start_choices(engine, tokens.prompt, params, rid, req.n, ops, "messages", trace)
    with_usage = has_cache_ops(req) or bool(req.stream_options and req.stream_options.include_usage)
    lasts: list[RequestOutput] = [first for _, first in choices]
    done = False
    try:
        if not req.stream:
            async for i, out in merged(choices):
                parsers[i].step(out)
                lasts[i] = out
            done = True
            for last in lasts:
                check_failed(last)
            built = []
            for i, (parser, last) in enumerate(zip(parsers, lasts)):
                message, finish_reason = parser.message(last.finish_reason)
                built.append(ChatChoice(i, message, finish_reason, parser.logprobs_all()))
            body = ChatCompletion(rid, created, model, built, usage_info(total_usage(lasts)))
            return web.Response(body=msgspec.json.encode(body), content_type=JSON)

        response = request[SSE_STREAM] = await open_sse(request)

        async def send(choices: list[ChunkChoice], usage: UsageInfo | None = None) -> None:
            chunk = ChatCompletionChunk(rid, created, model, choices, usage)
            await response.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")

        for i in range(req.n):
            await send([ChunkChoice(i, Delta(role="assistant", content=""))])
        async for i, out in merged(choices):
            lasts[i] = out
            for delta, lps in parsers[i].deltas(out):
                await send([ChunkChoice(i, delta, None, lps)])
            if out.finished and out.finish_reason == "error":
                done = True
                await write_stream_error(response, out)
                return response
            if out.finished:
                await send([ChunkChoice(i, Delta(), parsers[i].finish_reason(out.finish_reason))])
        done = True
        if with_usage:
            await send([], usage_info(total_usage(lasts)))
        await close_sse(response)
        return response
    finally:
        await finish_choices(engine, choices, rid, done)


# ---------------------------------------------------------------------------------------------------------
# /v1/completions


async def completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    engine, settings = request.app[ENGINE], request.app[SETTINGS]
    req, _ = await prepare.decode(await request.read(), CompletionRequest)
    prompts.check_common(req, settings["accepted"])
    prompts.check_completion(req)
    prompt = prompts.completion_prompt(req)
    params = prompts.sampling_params(req, 1, req.logprobs, settings["limits"])
    tokens = await tokenized(engine, prompt, None, "prompt")
    params.max_tokens = limits.max_tokens(
        req.max_tokens, "max_tokens", tokens.next_pos, engine.max_model_len, 16, "prompt"
    )
    rid, created, model = new_id("cmpl"), int(time.time()), settings["names"][0]
    trace = new_trace(request, rid, arrival, prompt)
    choices = await start_choices(engine, tokens.prompt, params, rid, req.n, None, "prompt", trace)
    builders = [
        output.CompletionLogprobsBuilder(engine) if req.logprobs is not None else None for _ in choices
    ]
    texts, lasts = [""] * req.n, [first for _, first in choices]
    done = False
    try:
        if not req.stream:
            async for i, out in merged(choices):
                texts[i] += out.text
                lasts[i] = out
                if builders[i] is not None:
                    builders[i].add(out)
            done = True
            for last in lasts:
                check_failed(last)
            built = [CompletionChoice(i, texts[i], lasts[i].finish_reason, b.build() if b else None)
                     for i, b in enumerate(builders)]  # fmt: skip
            body = Completion(rid, created, model, built, usage_info(total_usage(lasts)))
            return web.Response(body=msgspec.json.encode(body), content_type=JSON)

        response = request[SSE_STREAM] = await open_sse(request)
        async for i, out in merged(choices):
            lasts[i] = out
            chunk_lps, lps = None, builders[i]
            if lps is not None:
                chunk_lps = output.CompletionLogprobsBuilder(engine, lps.offset).add(out).build()
                lps.add(out)
            if out.finished and out.finish_reason == "error":
                done = True
                await write_stream_error(response, out)
                return response
            if out.text or out.finished or chunk_lps is not None:
                choice = CompletionChoice(i, out.text, out.finish_reason, chunk_lps)
                await response.write(
                    b"data: " + msgspec.json.encode(Completion(rid, created, model, [choice])) + b"\n\n"
                )
        done = True
        if req.stream_options and req.stream_options.include_usage:
            chunk = Completion(rid, created, model, [], usage_info(total_usage(lasts)))
            await response.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
        await close_sse(response)
        return response
    finally:
        await finish_choices(engine, choices, rid, done)


# ---------------------------------------------------------------------------------------------------------
# models, health, metrics


async def models(request: web.Request) -> web.Response:
    engine, settings = request.app[ENGINE], request.app[SETTINGS]
    cards = [ModelCard(name, int(time.time()), engine.max_model_len) for name in settings["names"]]
    return web.Response(body=msgspec.json.encode(ModelList(cards)), content_type=JSON)


async def model(request: web.Request) -> web.Response:
    """One model's card; any name the server accepts as `model` has one, under the name asked for."""
    engine, settings = request.app[ENGINE], request.app[SETTINGS]
    name = request.match_info["model"]
    if name not in settings["accepted"]:
        raise prompts.unknown_model(name, settings["accepted"])
    card = ModelCard(name, int(time.time()), engine.max_model_len)
    return web.Response(body=msgspec.json.encode(card), content_type=JSON)


async def openapi(request: web.Request) -> web.Response:
    engine, settings = request.app[ENGINE], request.app[SETTINGS]
    names = (*settings["names"], *sorted(settings["accepted"] - set(settings["names"])))
    doc = openapi_document(names, settings["limits"], engine.max_model_len, settings["api_key"] is not None)
    return web.Response(body=doc, content_type=JSON)


async def health(request: web.Request) -> web.Response:
    return web.Response(body=b'{"status":"ok"}', content_type=JSON)


async def metrics(request: web.Request) -> web.Response:
    body = await asyncio.to_thread(request.app[METRICS].render)  # engine.stats() may wait for a step
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})
