"""The root of every request's trace: one SERVER span per API request, under the client's W3C
`traceparent` when it sent one.

An ASGI wrapper around the whole app rather than code in the handler: a streamed response goes
on after the handler returns, and the span must last until its last byte. While it runs the span
is the current one, so every processor call made for the request carries its trace context
(`outgoing_metadata()` in processor_stream.py).

Only the API's own paths are traced (a fixed set, so span names stay few); probes and metrics
scrapes are not.
"""

from __future__ import annotations

from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.mesh.tracing import Tracing

TRACED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models"})
# Response headers copied onto the span: where the request ran and the id the client knows it by.
SPAN_HEADERS = {b"x-request-id": "kvmesh.client_request_id", b"x-kvmesh-worker": "kvmesh.worker_id",
                b"x-kvmesh-prefill": "kvmesh.prefill"}


class RequestTracing:
    def __init__(self, app: ASGIApp, tracing: Tracing) -> None:
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path not in TRACED_PATHS:
            await self.app(scope, receive, send)
            return
        method = scope.get("method", "GET")
        parent = self.tracing.http_parent(scope.get("headers", ()))
        with self.tracing.tracer.start_as_current_span(
                f"{method} {path}", context=parent, kind=SpanKind.SERVER,
                attributes={"http.request.method": method, "url.path": path, "http.route": path}) as span:

            async def send_traced(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                    span.set_attribute("http.response.status_code", status)
                    for name, value in message.get("headers", ()):
                        if (key := SPAN_HEADERS.get(name.lower())) is not None:
                            span.set_attribute(key, value.decode("latin-1"))
                    if status >= 500:
                        # A server failure; 4xx is the client's and leaves the span unset (HTTP semantic conventions).
                        span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
                await send(message)

            await self.app(scope, receive, send_traced)
