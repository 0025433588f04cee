"""`POST /v1/responses`: the OpenAI Responses API over the chat machinery.

A request is converted into a chat request (responses.py: input items -> chat messages, with the numbering
that cache operations use) and then runs exactly as /v1/chat/completions does: the same prompt
(prompts.chat_prompt, thinking_drop included), the same sampling checks, the same engine stream, output
parser, metrics and log line. The reply is built from the parsed pieces (responses_output.py), as one
`response` object or as the Responses event stream, `event: <type>` + `data: <json>` per event, ending
with the terminal event (no `[DONE]`, as OpenAI's own stream).

Nothing is stored: `store` is accepted and ignored, `previous_response_id` gets a 400. Errors before the
first byte are plain HTTP errors in the OpenAI shape, with `param` naming the request field (`input[3]`
rather than the chat message it became); an engine failure after the stream started ends it with
`response.failed`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from minakv.server import output, prompts
from minakv.server.protocol import RequestError, decode_request
from minakv.server.responses import ResponsesRequest, input_param, to_chat
from minakv.server.responses_output import ResponseBuilder
from minakv.server.running import ENGINE_FAILED, bad_prompt, check_failed, finish, open_sse, start

JSON = "application/json"


async def create_response(request: web.Request) -> web.StreamResponse:
    from minakv.server.app import ENGINE, SETTINGS, new_trace  # app.py imports this module for the route

    arrival = time.monotonic()
    engine, settings = request.app[ENGINE], request.app[SETTINGS]
    req: ResponsesRequest = decode_request(await request.read(), ResponsesRequest)
    chat, raw, conv = to_chat(req)
    prompts.check_common(chat, settings["accepted"])
    params = prompts.sampling_params(chat, req.max_output_tokens or engine.max_model_len, None)
    try:
        prompt, ops, tools_on = prompts.chat_prompt(chat, raw)
        tools = raw["tools"] if tools_on else None
        if ops is not None and ops.thinking_drop:
            prompt = prompts.thinking_drop_prompt(engine.tokenizer, prompt, ops)
    except RequestError as e:
        e.param = input_param(e.param, conv)
        raise
    except ValueError as e:
        err = bad_prompt(e, "input")
        raise RequestError(err.message, input_param(err.param, conv)) from None
    rid, model = f"resp_{uuid.uuid4().hex}", settings["names"][0]
    parser = output.ChatParser(engine.arch, engine.tokenizer, tools)
    builder = ResponseBuilder(rid, model, req, tools, engine.tokenizer)
    trace = new_trace(request, rid, arrival, prompt)
    try:
        stream, first = await start(engine, prompt, params, rid, ops, "input", trace)
    except RequestError as e:  # the renderer's errors name chat messages
        e.param = input_param(e.param, conv)
        raise
    done = False
    try:
        if not req.stream:
            out = first
            builder.add(parser.step(out))
            while not out.finished:
                out = await stream.__anext__()
                builder.add(parser.step(out))
            done = True
            check_failed(out)
            builder.finish(out)
            return web.Response(body=msgspec.json.encode(builder.response()), content_type=JSON)

        response = await open_sse(request)
        await send(response, builder.start())
        out = first
        while True:
            await send(response, builder.add(parser.step(out)))
            if out.finished:
                break
            out = await stream.__anext__()
        done = True
        await send(
            response, builder.fail(ENGINE_FAILED) if out.finish_reason == "error" else builder.finish(out)
        )
        await response.write_eof()
        return response
    finally:
        await finish(engine, stream, rid, done)


async def send(response: web.StreamResponse, events: list[dict[str, Any]]) -> None:
    """Server-sent events as OpenAI writes them: the type on the `event:` line, the event as `data:`."""
    if events:
        frames = (b"event: %s\ndata: %s\n\n" % (e["type"].encode(), msgspec.json.encode(e)) for e in events)
        await response.write(b"".join(frames))
