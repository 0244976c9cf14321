"""The OpenAI-compatible HTTP gateway: validates, forwards to a processor, shapes the answer."""

from __future__ import annotations

import logging
import time
import itertools
from functools import partial
from typing import cast
import secrets
from collections.abc import Iterator

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp

from gen.kvmesh.v1 import common_pb2
from services.frontend import openapi
from services.frontend.answer import Answer, ClientGone, SseResponse, collect_unless_gone, first_route, unless_gone
from services.frontend.auth import check_api_key, presented_key
from services.frontend.qos import OutsideQueue, request_qos
from services.frontend.sessions import request_session
from services.frontend.refusal_memory import RefusalMemory, RequestKind
from services.frontend.body import read_json
from services.frontend.direct_write import body_writer
from services.frontend.config import FrontendConfig
from services.frontend.images import ImageLoader, PartKey
from services.frontend.endpoints import CHAT, COMPLETION, RESPONSES, Kind, processor_requests
from services.frontend.errors import ApiError, shown
from services.frontend.fast_paths import FastPaths
from services.frontend.inflight import InflightLimit, Lease
from services.frontend.lora_admin import LoraAdmin
from services.frontend.lora_api import LoadLoraAdapterRequest, UnloadLoraAdapterRequest, add_lora_routes
from services.frontend.mesh import MeshView, ModelTarget
from services.frontend.client_fields import ClientFields
from services.frontend.context_edits import apply_edits
from services.frontend.messages_api import COUNT_TOKENS, MESSAGES, MessageShape, message_body
from services.frontend.messages_api import agent_session as messages_agent_session
from services.frontend.messages_api import chat_body as messages_chat_body
from services.frontend.messages_api import nested_accepted as messages_nested
from services.frontend.messages_count import COUNT_TIMEOUT_S, count_tokens
from services.frontend.messages_events import message_events
from services.frontend.messages_schemas import CountTokensRequest, MessagesRequest, parse_messages
from services.frontend.metrics import FrontendMetrics
from services.frontend.processor_stream import ProcessorStream
from services.frontend.route_header import EXPLAIN_HEADER, ROUTE_HEADER, route_header, wants_explanation
from services.frontend.responses import prefill_header
from services.frontend.responses_api import ResponseBuilder, response_events
from services.frontend.responses_input import agent_session as responses_agent_session
from services.frontend.responses_input import chat_body
from services.frontend.responses_input import nested_accepted as responses_nested
from services.frontend.schemas import ChatCompletionRequest, CompletionRequest, GenerationRequest, parse
from services.mesh.channels import ChannelPool
from services.mesh.logs import REQUEST_ID
from services.mesh.recent_failures import RecentFailures

log = logging.getLogger(__name__)


def create_app(config: FrontendConfig, mesh: MeshView, metrics: FrontendMetrics, lora: LoraAdmin,
               channels: ChannelPool) -> ASGIApp:
    """The gateway's routes; `/openapi.json` describes them, request bodies included. The
    generation endpoints are reached ahead of the app's routing stack (fast_paths.py).
    `channels`: the process's gRPC channels (unary calls to processors: count_tokens)."""
    app = FastAPI(title="kvmesh", version="1", docs_url=None, redoc_url=None)
    gateway = _Gateway(config, mesh, metrics, channels)
    openapi.install(app, [ChatCompletionRequest, CompletionRequest, MessagesRequest, CountTokensRequest,
                          LoadLoraAdapterRequest, UnloadLoraAdapterRequest])

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = ApiError(exc.status_code, str(exc.detail))
        return error.anthropic_response() if request.url.path.startswith("/v1/messages") else error.response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        """A bug still answers in the OpenAI shape (500); bad input never gets here. (Starlette
        re-raises it afterwards, so the server logs the traceback.)"""
        log.error("unhandled %s on %s %s: %s", type(exc).__name__, request.method, request.url.path, exc)
        return ApiError(500, "internal error", code="internal_error").response()

    if config.metrics_port is None:
        add_admin_routes(app, mesh, metrics)

    @app.api_route("/api/hello", methods=["GET", "HEAD"], include_in_schema=False)
    async def hello() -> JSONResponse:
        """Claude Code's reachability check (`HEAD /api/hello` on its base URL before its first
        request): the gateway is here. Nothing is asked of the mesh."""
        return JSONResponse({})

    # /v1/models and the LoRA admin endpoints (lora_api.py).
    add_lora_routes(app, mesh, lora, config.api_keys, config.max_body_bytes, config.allow_runtime_lora)

    @app.post("/v1/chat/completions", openapi_extra=openapi.request_body(ChatCompletionRequest),
              responses=openapi.ERROR_RESPONSES)
    async def chat(request: Request) -> Response:
        return await gateway.handle(request, CHAT)

    @app.post("/v1/completions", openapi_extra=openapi.request_body(CompletionRequest),
              responses=openapi.ERROR_RESPONSES)
    async def completions(request: Request) -> Response:
        return await gateway.handle(request, COMPLETION)

    @app.post("/v1/responses", responses=openapi.ERROR_RESPONSES)
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API, stateless (store: false): text, tools and streaming events."""
        return await gateway.handle(request, RESPONSES)

    @app.post("/v1/messages", openapi_extra=openapi.request_body(MessagesRequest),
              responses=openapi.ANTHROPIC_ERROR_RESPONSES)
    async def messages(request: Request) -> Response:
        """Anthropic's Messages API: text, tools, thinking, whole or as typed events; errors in
        Anthropic's shape (messages_api.py)."""
        return await gateway.handle(request, MESSAGES)

    @app.post("/v1/messages/count_tokens", openapi_extra=openapi.request_body(CountTokensRequest),
              responses=openapi.ANTHROPIC_ERROR_RESPONSES)
    async def count_message_tokens(request: Request) -> Response:
        """A Message's prompt tokens, counted as /v1/messages would count them: {input_tokens}."""
        return await gateway.count_tokens(request)

    return FastPaths(app, {"/v1/chat/completions": chat, "/v1/completions": completions, "/v1/responses": responses,
                           "/v1/messages": messages, "/v1/messages/count_tokens": count_message_tokens})


def create_admin_app(mesh: MeshView, metrics: FrontendMetrics) -> FastAPI:
    """/health, /live and /metrics alone, for a port that need not be public."""
    app = FastAPI(title="kvmesh admin", docs_url=None, redoc_url=None, openapi_url=None)
    add_admin_routes(app, mesh, metrics)
    return app


def add_admin_routes(app: FastAPI, mesh: MeshView, metrics: FrontendMetrics) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        """200 when a router and a decode worker serve the model: the readiness probe."""
        ok, reason = mesh.health()
        return JSONResponse({"status": "ok" if ok else "unavailable", "reason": reason}, status_code=200 if ok else 503)

    @app.get("/live")
    async def live() -> JSONResponse:
        """200 while the gateway answers at all: the liveness probe (a mesh without workers is
        not a reason to restart the gateway)."""
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


def request_ids() -> Iterator[str]:
    """Request ids unique across the mesh, cheaply: a random 64-bit prefix per process and a
    counter (a uuid4 per request costs a system call for its randomness)."""
    prefix = secrets.token_hex(8)
    return (f"{prefix}{n:08x}" for n in itertools.count())


class _Gateway:
    def __init__(self, config: FrontendConfig, mesh: MeshView, metrics: FrontendMetrics,
                 channels: ChannelPool) -> None:
        self.config = config
        self.mesh = mesh
        self.channels = channels
        self.metrics = metrics
        self.inflight = InflightLimit(config.max_inflight, metrics.inflight)
        # Processors seen failing, kept out of the gateway's choices until they are surely gone.
        self.failed_processors = RecentFailures()
        self.outside_queue = OutsideQueue()
        self.refusals = RefusalMemory()
        self.fields = ClientFields(metrics.client_fields)
        self.images = ImageLoader(config.images)
        metrics.refused_from_memory.set_function(lambda: self.refusals.answered)
        self._ids = request_ids()

    async def handle(self, request: Request, kind: Kind) -> Response:
        """One API request: checked, admitted against the in-flight limit, routed, then answered.

        Every refusal is an ApiError in the OpenAI shape (Anthropic's on the Messages API); the
        in-flight lease taken at admission is released exactly once whatever happens (refusal,
        failure, client gone, normal end)."""
        started = time.perf_counter()
        # Our own id inside the mesh: a client's x-request-id is only echoed (two clients may
        # send the same one, and engines need unique ids).
        rid = next(self._ids)
        REQUEST_ID.set(rid)  # this request's task: every line it logs carries the id
        headers = {"x-request-id": request.headers.get("x-request-id") or rid}
        streams: list[ProcessorStream] = []
        lease: Lease | None = None
        kind_of: RequestKind | None = None
        try:
            key = check_api_key(presented_key(request.headers), self.config.api_keys)
            body = await read_json(request, self.config.max_body_bytes)
            original = body if kind is RESPONSES and isinstance(body, dict) else None
            agent: tuple[str, str] | None = None
            if kind is MESSAGES:
                parsed = parse_messages(MessagesRequest, body)
                if parsed.context_management is not None:
                    # Its edits may ask processors for counts: within the in-flight limit too.
                    lease = self.inflight.acquire(1)
                message, shape = await self._edited(rid, parsed)
                self.fields.note("messages", cast(dict, body), messages_nested(message))
                agent = messages_agent_session(message)
                body = messages_chat_body(message)
            elif original is not None:
                self.fields.note("responses", original, responses_nested(original))
                agent = responses_agent_session(original)
            req = parse(kind.schema, chat_body(original) if original is not None else body)
            # A base model, or a LoRA adapter of one: the processors are the base's, and the
            # answer names the model the client named.
            target = self._target(req.model)
            self.metrics.arrived.inc()
            lease = lease or self.inflight.acquire(req.streams())
            explain = self.config.allow_explain and wants_explanation(request.headers.get(EXPLAIN_HEADER))
            qos = request_qos(request.headers, req.priority, self.config.tenant_of_key(key), self.config.tenant_header,
                              self.outside_queue.p90_ms)
            session = self._session(request, req.user, kind, agent)
            kind_of = (req.model, qos.tenant, qos.priority, qos.ttft_objective_ms)
            if (refused := self.refusals.recall(kind_of)) is not None:
                raise refused
            images = await self._images(req)
            streams = [ProcessorStream(self.mesh, msg, self.config.request_timeout_s, self.failed_processors)
                       for msg in processor_requests(rid, req, target, explain, qos, session, images)]
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
            if kind_of is not None and streams:
                self.refusals.remember(kind_of, exc)
            return self._refuse(exc, rid, kind, headers)
        prefill = prefill_header(route.prefill)
        if not self.config.hide_routing_details:
            headers["x-kvmesh-worker"] = route.worker_id
            headers["x-kvmesh-prefill"] = prefill
        if route.queue_wait_ms:
            headers["x-kvmesh-queue-wait-ms"] = str(route.queue_wait_ms)
        if explain and route.HasField("explanation"):
            headers[ROUTE_HEADER] = route_header(route.explanation)
        log.info("request %s: %s %d prompt tokens x %d streams -> worker %s (%s prefill)%s%s%s", rid, kind.endpoint,
                 route.prompt_tokens, req.streams(), route.worker_id, prefill,
                 f" adapter {target.lora_name!r}" if target.lora_name else "",
                 f" session {session.id!r}" if session is not None else "",
                 f" client id {headers['x-request-id'][:64]!r}" if headers["x-request-id"] != rid else "")
        answer = Answer(self.metrics, kind, req, rid, streams, started, lease,
                        hide_details=self.config.hide_routing_details,
                        first_shown=partial(self.outside_queue.observe, queue_wait_ms=route.queue_wait_ms))
        builder = ResponseBuilder(rid, req.model, original) if original is not None else None
        hide = self.config.hide_routing_details
        if req.stream:
            if kind is MESSAGES:
                events = message_events(rid, req.model, route.prompt_tokens, answer.items(), answer.usage, hide,
                                        shape)
            elif builder is not None:
                events = response_events(builder, answer.items(), answer.usage)
            else:
                events = answer.sse(body_writer(request.scope))
            return SseResponse(events, answer.close, media_type="text/event-stream", headers=headers)
        try:
            out = await collect_unless_gone(answer, request.receive)
        except ClientGone:
            return Response(status_code=499)  # nobody is there to read it
        except ApiError as exc:
            return self._shaped(shown(exc, hide), kind, headers)
        if kind is MESSAGES:
            return JSONResponse(message_body(rid, req.model, out, shape), headers=headers)
        return JSONResponse(builder.from_chat(out) if builder is not None else out, headers=headers)

    async def count_tokens(self, request: Request) -> Response:
        """`POST /v1/messages/count_tokens`: the request's prompt rendered and counted by a
        processor (messages_count.py); refusals in Anthropic's shape, as on /v1/messages."""
        rid = next(self._ids)
        REQUEST_ID.set(rid)
        headers = {"x-request-id": request.headers.get("x-request-id") or rid}
        lease: Lease | None = None
        try:
            check_api_key(presented_key(request.headers), self.config.api_keys)
            # Counted against the in-flight limit as a generation is: a flood of large counts
            # must meet the same 429, not starve generation's tokenizing.
            lease = self.inflight.acquire(1)
            body = await read_json(request, self.config.max_body_bytes)
            message, _ = await self._edited(rid, parse_messages(CountTokensRequest, body))
            tokens = await unless_gone(self._count(rid, message), request.receive)
        except ApiError as exc:
            return self._refuse(exc, rid, COUNT_TOKENS, headers)
        finally:
            if lease is not None:
                lease.release()
        self.metrics.requests.labels(COUNT_TOKENS.endpoint, "200").inc()
        return JSONResponse({"input_tokens": tokens}, headers=headers)

    async def _images(self, req: GenerationRequest) -> dict[PartKey, bytes]:
        """The bytes of a chat request's images (images.py)."""
        refs = req.image_refs() if isinstance(req, ChatCompletionRequest) else []
        return await self.images.load(refs) if refs else {}

    def _target(self, model: str) -> ModelTarget:
        """What `model` names: a base model, or a LoRA adapter of one; else a 404."""
        target = self.mesh.resolve(model)
        if target is None:
            raise ApiError(404, f"the model {model[:200]!r} does not exist", param="model", code="model_not_found")
        return target

    async def _count(self, rid: str, message: CountTokensRequest) -> int:
        """A Messages request's prompt tokens, counted by a processor (messages_count.py)."""
        req = parse(ChatCompletionRequest, messages_chat_body(message))
        [msg] = processor_requests(rid, req, self._target(req.model), images=await self._images(req))
        return await count_tokens(self.mesh, self.channels, msg, self.failed_processors,
                                  min(COUNT_TIMEOUT_S, self.config.request_timeout_s))

    async def _edited(self, rid: str, message: CountTokensRequest) -> tuple[CountTokensRequest, MessageShape]:
        """The Messages request with its context edits applied (context_edits.py), and the
        answer's shape that reports them."""
        edited, applied = await apply_edits(message, partial(self._count, rid))
        if applied:
            log.info("request %s: context edits applied: %s", rid,
                     ", ".join(f"{e['type']} -{e['cleared_input_tokens']} tokens" for e in applied))
        return edited, MessageShape.of(edited, applied)

    def _session(self, request: Request, user: str | None, kind: Kind,
                 agent: tuple[str, str] | None = None) -> common_pb2.SessionRef | None:
        """The request's agent session (sessions.py); on the Messages API a bad `user` is named
        as the field the client sent, `metadata.user_id`."""
        try:
            return request_session(request.headers, user, self.config.session_from_user, agent)
        except ApiError as exc:
            if kind is not MESSAGES or exc.param != "user":
                raise
            raise ApiError(400, "metadata.user_id: " + exc.message.removeprefix("user "), param="metadata.user_id",
                           code=exc.code) from None

    def _refuse(self, exc: ApiError, rid: str, kind: Kind, headers: dict[str, str]) -> Response:
        self.metrics.requests.labels(kind.endpoint, str(exc.status)).inc()
        if exc.status >= 500 or exc.status == 429:
            log.warning("request %s: %d %s", rid, exc.status, exc.message)
        else:
            log.info("request %s: %d %s", rid, exc.status, exc.code)
        return self._shaped(shown(exc, self.config.hide_routing_details), kind, headers)

    @staticmethod
    def _shaped(exc: ApiError, kind: Kind, headers: dict[str, str]) -> Response:
        """The error body in the shape of the endpoint's API."""
        if kind is MESSAGES or kind is COUNT_TOKENS:
            return exc.anthropic_response(headers)
        return exc.response(headers)
