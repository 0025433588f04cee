"""`POST /v1/messages`: the Anthropic Messages API (MiniMax-M2's recommended API) over the chat machinery.

A request is converted into a chat request (anthropic_input.py: messages, tools, the message numbering
that cache operations use) and then runs exactly as /v1/chat/completions does: the same prompt
(prompts.chat_prompt), the same cache operations, the same engine stream and output parser. The reply is
built from the parsed pieces (anthropic_output.py), in one JSON body or as Anthropic's event stream:

    event: message_start         the message, no content yet
    event: content_block_start   per block: thinking, text or tool_use
    event: content_block_delta   thinking_delta / text_delta / input_json_delta
    event: content_block_stop
    event: message_delta         stop_reason, stop_sequence, usage
    event: message_stop

Errors on this route have Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, with the
field at fault at the start of the message (the shape has no `param`). The engine reports the prompt's
token counts when the request finishes, so `message_start` carries zeros and `message_delta` the usage.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from minakv.outputs import RequestOutput, Usage
from minakv.server import output, prompts
from minakv.server.anthropic_input import MessagesRequest, chat_request, to_chat
from minakv.server.anthropic_output import Blocks, matched_stop, message, stop_reason, usage
from minakv.server.protocol import RequestError, decode_request
from minakv.server.running import ENGINE_FAILED, bad_prompt, check_failed, finish, new_id, open_sse, start

log = logging.getLogger("minakv.server")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_body(err: RequestError) -> dict[str, Any]:
    message = err.message
    if err.param and not message.startswith(err.param):
        message = f"{err.param}: {message}"
    return {"type": "error", "error": {"type": ERROR_TYPES.get(err.status, "api_error"), "message": message}}


def error_response(err: RequestError) -> web.Response:
    return web.Response(
        status=err.status, body=msgspec.json.encode(error_body(err)), content_type="application/json"
    )


async def messages(request: web.Request) -> web.StreamResponse:
    """The route: every refusal in Anthropic's error shape (app.py's middleware would answer OpenAI's)."""
    try:
        return await answer(request)
    except RequestError as e:
        return error_response(e)
    except web.HTTPRequestEntityTooLarge as e:
        return error_response(RequestError(f"request body too large: {e.text}", status=413))
    except (ConnectionError, asyncio.CancelledError):
        raise  # the client is gone; nothing to answer
    except (
        Exception
    ):  # a bug: answer 500 in this route's shape (the details go to the log only), keep serving
        log.exception("error while handling %s", request.path)
        return error_response(RequestError("internal error; see the server log", status=500))


async def answer(request: web.Request) -> web.StreamResponse:
    from minakv.server.app import ENGINE, SETTINGS, new_trace  # app.py imports this module for the route

    arrival = time.monotonic()
    engine, settings = request.app[ENGINE], request.app[SETTINGS]
    req: MessagesRequest = decode_request(await request.read(), MessagesRequest)
    if req.model not in settings["accepted"]:
        raise RequestError(
            f"The model {req.model!r} does not exist; this server serves {sorted(settings['accepted'])}",
            "model",
        )
    if req.max_tokens < 1:
        raise RequestError(f"max_tokens must be a positive integer, got {req.max_tokens}", "max_tokens")
    conv = to_chat(req)
    rid, model = new_id("msg"), settings["names"][0]
    try:
        chat = chat_request(req, conv)
        params = prompts.sampling_params(chat, req.max_tokens, None)
        prompt, ops, tools_on = prompts.chat_prompt(chat, {"messages": conv.messages, "tools": conv.tools})
        if ops is not None and ops.thinking_drop:
            try:
                prompt = prompts.thinking_drop_prompt(engine.tokenizer, prompt, ops)
            except RequestError:
                raise
            except ValueError as e:
                raise bad_prompt(e, "messages") from None
        trace = new_trace(request, rid, arrival, prompt)
        stream, first = await start(engine, prompt, params, rid, ops, "messages", trace)
    except RequestError as e:  # name the field as the client wrote it
        e.param = "stop_sequences" if e.param == "stop" else conv.field_name(e.param)
        raise
    parser = output.ChatParser(engine.arch, engine.tokenizer, prompt.get("tools") if tools_on else None)
    blocks = Blocks()
    done = False
    try:
        if not req.stream:
            last, ids, text = await run(stream, first, parser, blocks, None)
            done = True
            check_failed(last)
            body = reply(engine.tokenizer, req, rid, model, blocks, last, ids, text)
            return web.Response(body=msgspec.json.encode(body), content_type="application/json")

        response = await open_sse(request)

        async def send(event: dict[str, Any]) -> None:
            await response.write(
                b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"
            )

        zeros = usage(Usage())
        await send({"type": "message_start", "message": message(rid, model, [], None, None, zeros)})
        last, ids, text = await run(stream, first, parser, blocks, send)
        done = True
        if last.finish_reason == "error":
            await send(error_body(RequestError(ENGINE_FAILED, status=500)))
        else:
            for event in blocks.close():
                await send(event)
            body = reply(engine.tokenizer, req, rid, model, blocks, last, ids, text)
            delta = {"stop_reason": body["stop_reason"], "stop_sequence": body["stop_sequence"]}
            await send({"type": "message_delta", "delta": delta, "usage": body["usage"]})
            await send({"type": "message_stop"})
        await response.write_eof()
        return response
    finally:
        await finish(engine, stream, rid, done)


async def run(
    stream: Any,
    first: RequestOutput,
    parser: output.ChatParser,
    blocks: Blocks,
    send: Callable[[dict[str, Any]], Awaitable[None]] | None,
) -> tuple[RequestOutput, list[int], str]:
    """Feed every increment through the parser into `blocks`, sending the events when streaming. Returns
    the last increment and the whole output's token ids and text (for the stop-sequence check)."""
    out, ids, text = first, [], []
    while True:
        ids += out.token_ids
        text.append(out.text)
        for event in blocks.add(parser.step(out)):
            if send is not None:
                await send(event)
        if out.finished:
            return out, ids, "".join(text)
        out = await stream.__anext__()


def reply(
    tokenizer: Any,
    req: MessagesRequest,
    rid: str,
    model: str,
    blocks: Blocks,
    last: RequestOutput,
    ids: list[int],
    text: str,
) -> dict[str, Any]:
    """The whole message, once the output is finished (closing the block still open)."""
    blocks.close()
    matched = matched_stop(tokenizer, ids, text, req.stop_sequences) if last.finish_reason == "stop" else None
    reason = stop_reason(last.finish_reason, blocks.called, matched)
    sequence = matched if reason == "stop_sequence" else None
    return message(rid, model, blocks.content, reason, sequence, usage(last.usage))
