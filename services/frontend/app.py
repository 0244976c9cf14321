"""The OpenAI-compatible HTTP gateway: validates, forwards to a processor, shapes the answer."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from services.frontend import openapi
from services.frontend.answer import Answer, SseResponse, collect_unless_gone, first_route, unless_gone
from services.frontend.auth import check_api_key
from services.frontend.body import read_json
from services.frontend.endpoints import CHAT, COMPLETION, Kind, processor_requests
from services.frontend.errors import ApiError
from services.frontend.inflight import InflightLimit, Lease
from services.frontend.mesh import MeshView
from services.frontend.metrics import FrontendMetrics
from services.frontend.processor_stream import ProcessorStream
from services.frontend.responses import prefill_header
from services.frontend.schemas import ChatCompletionRequest, CompletionRequest, parse
from services.mesh.flags import ConfigError
from services.mesh.recent_failures import RecentFailures

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FrontendConfig:
    api_key: str | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    max_inflight: int = 2048
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.api_key is not None and (not self.api_key or not self.api_key.isascii() or " " in self.api_key):
            raise ConfigError("--api-key must be non-empty printable ASCII without spaces")
        for flag, value in (("--max-body-bytes", self.max_body_bytes), ("--max-inflight", self.max_inflight)):
            if value <= 0:
                raise ConfigError(f"{flag} must be > 0, got {value}")
        if not self.request_timeout_s > 0:
            raise ConfigError(f"--request-timeout must be > 0, got {self.request_timeout_s}")


def create_app(config: FrontendConfig, mesh: MeshView, metrics: FrontendMetrics) -> FastAPI:
    """The gateway's routes; `/openapi.json` describes them, request bodies included."""
    app = FastAPI(title="kvmesh", version="1", docs_url=None, redoc_url=None)
    gateway = _Gateway(config, mesh, metrics)
    openapi.install(app, [ChatCompletionRequest, CompletionRequest])

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return ApiError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        """A bug still answers in the OpenAI shape (500); bad input never gets here. (Starlette
        re-raises it afterwards, so the server logs the traceback.)"""
        log.error("unhandled %s on %s %s: %s", type(exc).__name__, request.method, request.url.path, exc)
        return ApiError(500, "internal error", code="internal_error").response()

    @app.get("/health")
    async def health() -> JSONResponse:
        ok, reason = mesh.health()
        return JSONResponse({"status": "ok" if ok else "unavailable", "reason": reason}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses={401: openapi.ERROR_RESPONSES[401]})
    async def models(request: Request) -> JSONResponse:
        try:
            check_api_key(request.headers.get("authorization"), config.api_key)
        except ApiError as exc:
            return exc.response()
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "kvmesh"} for m in mesh.models()]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/chat/completions", openapi_extra=openapi.request_body(ChatCompletionRequest),
              responses=openapi.ERROR_RESPONSES)
    async def chat(request: Request) -> Response:
        return await gateway.handle(request, CHAT)

    @app.post("/v1/completions", openapi_extra=openapi.request_body(CompletionRequest),
              responses=openapi.ERROR_RESPONSES)
    async def completions(request: Request) -> Response:
        return await gateway.handle(request, COMPLETION)

    return app


class _Gateway:
    def __init__(self, config: FrontendConfig, mesh: MeshView, metrics: FrontendMetrics) -> None:
        self.config = config
        self.mesh = mesh
        self.metrics = metrics
        self.inflight = InflightLimit(config.max_inflight, metrics.inflight)
        # Processors seen failing, kept out of the gateway's choices until they are surely gone.
        self.failed_processors = RecentFailures()

    async def handle(self, request: Request, kind: Kind) -> Response:
        """One API request: checked, admitted against the in-flight limit, routed, then answered.

        Every refusal is an ApiError in the OpenAI shape; the in-flight lease taken at admission
        is released exactly once whatever happens (refusal, failure, client gone, normal end)."""
        started = time.perf_counter()
        # Our own id inside the mesh: a client's x-request-id is only echoed (two clients may
        # send the same one, and engines need unique ids).
        rid = uuid.uuid4().hex
        headers = {"x-request-id": request.headers.get("x-request-id") or rid}
        streams: list[ProcessorStream] = []
        lease: Lease | None = None
        try:
            check_api_key(request.headers.get("authorization"), self.config.api_key)
            req = parse(kind.schema, await read_json(request, self.config.max_body_bytes))
            if not self.mesh.knows_model(req.model):
                raise ApiError(404, f"the model {req.model[:200]!r} does not exist", param="model",
                               code="model_not_found")
            lease = self.inflight.acquire(req.streams())
            streams = [ProcessorStream(self.mesh, msg, self.config.request_timeout_s, self.failed_processors)
                       for msg in processor_requests(rid, req)]
            # A client may leave while its prompt is prefilled, before any response: then the
            # request is cancelled along the whole chain instead of computed for nobody.
            route = await unless_gone(first_route(streams), request.receive)
        except BaseException as exc:
            # Nothing was handed to a stream yet: this is the only place to let go.
            for stream in streams:
                stream.cancel()
            if lease is not None:
                lease.release()
            if not isinstance(exc, ApiError):
                raise
            return self._refuse(exc, rid, kind, headers)
        headers["x-kvmesh-worker"] = route.worker_id
        headers["x-kvmesh-prefill"] = prefill_header(route.prefill)
        log.info("request %s: %s %d prompt tokens x %d streams -> worker %s (%s prefill)%s", rid, kind.endpoint,
                 route.prompt_tokens, req.streams(), route.worker_id, headers["x-kvmesh-prefill"],
                 f" client id {headers['x-request-id'][:64]!r}" if headers["x-request-id"] != rid else "")
        answer = Answer(self.metrics, kind, req, rid, streams, started, lease)
        if req.stream:
            return SseResponse(answer.sse(), answer.close, media_type="text/event-stream", headers=headers)
        body = await collect_unless_gone(answer, request.receive)
        if body is None:
            return Response(status_code=499)  # nobody is there to read it
        if isinstance(body, ApiError):
            return body.response(headers)
        return JSONResponse(body, headers=headers)

    def _refuse(self, exc: ApiError, rid: str, kind: Kind, headers: dict[str, str]) -> Response:
        self.metrics.requests.labels(kind.endpoint, str(exc.status)).inc()
        if exc.status >= 500 or exc.status == 429:
            log.warning("request %s: %d %s", rid, exc.status, exc.message)
        else:
            log.info("request %s: %d %s", rid, exc.status, exc.code)
        return exc.response(headers)
