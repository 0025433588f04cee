"""Every error the server sends, in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Errors come from three places:

- handlers raise `RequestError` (protocol.py) for what the client got wrong;
- aiohttp raises `HTTPException`s inside the handler chain: 404 for an unknown route, 405 for a wrong
  method, 413 for a body over the limit (from `request.read()`), and `RequestPayloadError` for a body it
  cannot decode (a broken gzip stream);
- a request aiohttp cannot even parse (a malformed header, a bad chunk size, an unknown content encoding)
  never reaches the application: aiohttp answers it from its protocol handler, as text/plain.

The `errors` middleware reshapes the first two; `Runner` (an `AppRunner`) gives the protocol handler the
same JSON error page for the third. Anything else is a bug: the client gets a 500 that says "internal
error" and a request id, the traceback goes to the log under that id (never to the client), and the server
keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from minakv.server.protocol import RequestError, error_body

log = logging.getLogger("minakv.server")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]


# A handler streaming OpenAI chunks registers its open stream here. A failure after the stream has started
# cannot become an HTTP error any more: the middleware ends the stream with an error event and [DONE].
SSE_STREAM = web.RequestKey("minakv_sse_stream", web.StreamResponse)


def error_response(err: RequestError) -> web.Response:
    return web.Response(status=err.status, body=error_body(err), content_type="application/json")


def internal_error(what: str, traceback: bool = True) -> RequestError:
    """A 500 for a bug: the client learns only an id to quote; the log gets the id and the traceback of the
    exception being handled."""
    error_id = uuid.uuid4().hex[:16]
    log.error("internal error %s while %s", error_id, what, exc_info=traceback)
    return RequestError(
        f"internal error (id {error_id}); the server log has the details",
        status=500,
        type="server_error",
        code="internal_error",
    )


def http_error(e: web.HTTPException, request: web.Request) -> RequestError:
    """aiohttp's HTTP errors, with a message that says what was asked for."""
    if e.status == 404:
        return RequestError(
            f"no route {request.path} (the routes: /openapi.json)", status=404, code="not_found"
        )
    if e.status == 405:
        return RequestError(
            f"{request.path} does not take {request.method}", status=405, code="method_not_allowed"
        )
    if e.status == 413:
        return RequestError(f"request body too large: {e.text}", status=413, code="request_too_large")
    kind = "server_error" if e.status >= 500 else "invalid_request_error"
    return RequestError(e.reason, status=e.status, type=kind)


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure of the handler chain as an OpenAI-style JSON error response."""
    try:
        return await handler(request)
    except RequestError as e:
        return await answer(request, e)
    except web.HTTPException as e:
        if e.status < 400:
            raise  # a redirect is not an error
        return error_response(http_error(e, request))
    except (web.RequestPayloadError, HttpProcessingError) as e:  # a body aiohttp could not read or decode
        reason = str(e).split("message:", 1)[-1].strip() or "unreadable body"
        return error_response(RequestError(f"could not read the request body: {reason}", code="bad_body"))
    except (ConnectionError, asyncio.CancelledError):
        raise  # the client is gone; nothing to answer
    except Exception:  # noqa: BLE001 (a bug: internal_error logs it with its traceback)
        return await answer(request, internal_error(f"handling {request.method} {request.path}"))


async def answer(request: web.Request, err: RequestError) -> web.StreamResponse:
    """`err` as an error response, or as the last event of the request's stream if one has started."""
    stream = request.get(SSE_STREAM)
    if stream is None or not stream.prepared:
        return error_response(err)
    with contextlib.suppress(ConnectionError):  # the client may be gone too
        await stream.write(b"data: " + error_body(err) + b"\n\ndata: [DONE]\n\n")
        await stream.write_eof()
    return stream


# ---------------------------------------------------------------------------------------------------------
# Requests that never reach the application


class _JsonErrorHandler(RequestHandler):
    """aiohttp's protocol handler with a JSON error page. `handle_error` answers requests the parser
    refused (`message` is the parser's description) and exceptions that escaped every middleware."""

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs it; raises if a response has started
        if status >= 500:  # 500: an exception past every middleware (logged just now); 504: a timeout
            err = internal_error(f"handling a request from {request.remote}", traceback=False)
            err.status = status
        else:
            # the parser's first line names the fault ("Invalid header token"); the rest quotes raw bytes
            first = (message or "").split("\n", 1)[0].split(": b'", 1)[0].rstrip(": ") or "bad request"
            err = RequestError(f"malformed HTTP request: {first}", status=status, code="bad_http_request")
        response = error_response(err)
        response.force_close()
        return response


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class Runner(web.AppRunner):
    """`web.AppRunner` whose connections answer unparsable requests in the OpenAI error shape too.

    aiohttp builds one protocol handler per connection by calling its `Server`; there is no setting for
    the handler class, so the server made by `AppRunner` becomes a `_JsonErrorServer` (a subclass that
    adds no state, only a different `__call__`). tests/test_server_hardening.py sends such requests, so
    an aiohttp upgrade that changes this seam fails there, not in production."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorServer
        return server
