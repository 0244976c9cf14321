"""The generation endpoints straight from the server, ahead of FastAPI's routing stack.

Every API request went through Starlette's middleware layers (error middleware, exception
middleware, exit stacks, the router's matching, the endpoint wrapper) before reaching the gateway:
about a fifth of the gateway's CPU per 1-token request, for nothing these endpoints use. So a
`POST` to a path in `routes` goes to its handler directly; everything else (other methods, the
models list, the OpenAPI document, the admin routes) goes to the FastAPI app as before, which
still describes every endpoint in `/openapi.json`. A handler answers every refusal itself (an
OpenAI error body); an exception it did not expect is logged with its traceback and answered
500 in the same shape, as the app's own handler does.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from services.frontend.errors import ApiError

log = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]


class FastPaths:
    def __init__(self, app: ASGIApp, routes: Mapping[str, Handler]) -> None:
        self.app = app
        self.routes = dict(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.routes.get(scope.get("path", "")) if scope["type"] == "http" else None
        if handler is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await handler(request)
        except Exception as exc:  # noqa: BLE001 - a bug still answers in the OpenAI shape
            log.exception("unhandled %s on POST %s: %s", type(exc).__name__, scope.get("path"), exc)
            response = ApiError(500, "internal error", code="internal_error").response()
        await response(scope, receive, send)
