"""The API key: with `--api-key KEY`, every `/v1/` route needs `Authorization: Bearer KEY`, or (as the
Anthropic SDK sends it) `x-api-key: KEY` (401 otherwise).

`/health`, `/metrics` and `/openapi.json` stay open, as in vLLM, so probes and scrapers need no secret. The
comparison takes the same time wherever the given key first differs (`hmac.compare_digest`), so timing
tells an attacker nothing about the key.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from minakv.server.errors import Handler, Middleware
from minakv.server.protocol import RequestError


def require_key(api_key: str) -> Middleware:
    expected, key = f"Bearer {api_key}".encode(), api_key.encode()

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/v1/"):
            given = request.headers.get("Authorization", "")
            other = request.headers.get("x-api-key", "")
            # both compared every time, so the timing does not tell which header was tried
            bearer_ok = hmac.compare_digest(given.encode(), expected)
            header_ok = hmac.compare_digest(other.encode(), key)
            if not (bearer_ok or (other and header_ok)):
                what = "Missing" if not given else "Incorrect"
                raise RequestError(
                    f"{what} API key: send 'Authorization: Bearer <key>'", status=401, code="invalid_api_key"
                )
        return await handler(request)

    return auth
