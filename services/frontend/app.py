"""The OpenAI-compatible HTTP gateway: validates, forwards to a processor, shapes the answer."""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse

from gen.kvmesh.v1 import common_pb2, processor_pb2
from services.mesh.flags import ConfigError
from services.mesh.streams import merge
from services.frontend.errors import ApiError, from_grpc
from services.frontend.mesh import MeshView
from services.frontend.metrics import FrontendMetrics
from services.frontend.responses import (
    SSE_DONE,
    ChoiceAccumulator,
    chat_logprobs,
    completion_logprobs,
    prefill_header,
    sse,
    usage_body,
)
from services.frontend.schemas import ChatCompletionRequest, CompletionRequest, parse

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


@dataclass(frozen=True)
class _Kind:
    endpoint: str
    schema: type
    object_name: str
    chunk_name: str
    id_prefix: str


CHAT = _Kind("chat", ChatCompletionRequest, "chat.completion", "chat.completion.chunk", "chatcmpl-")
COMPLETION = _Kind("completions", CompletionRequest, "text_completion", "text_completion", "cmpl-")


def create_app(config: FrontendConfig, mesh: MeshView, metrics: FrontendMetrics) -> FastAPI:
    app = FastAPI(title="kvmesh", version="1", docs_url=None, redoc_url=None)
    gateway = _Gateway(config, mesh, metrics)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return ApiError(exc.status_code, str(exc.detail)).response()

    @app.get("/health")
    async def health() -> JSONResponse:
        ok, reason = mesh.health()
        return JSONResponse({"status": "ok" if ok else "unavailable", "reason": reason}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        try:
            gateway.check_auth(request)
        except ApiError as exc:
            return exc.response()
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "kvmesh"} for m in mesh.models()]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await gateway.handle(request, CHAT)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await gateway.handle(request, COMPLETION)

    return app


class _Gateway:
    def __init__(self, config: FrontendConfig, mesh: MeshView, metrics: FrontendMetrics) -> None:
        self.config = config
        self.mesh = mesh
        self.metrics = metrics
        self.inflight = 0

    def check_auth(self, request: Request) -> None:
        if not self.config.api_key:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not token or not hmac.compare_digest(token, self.config.api_key):
            raise ApiError(401, "missing or invalid API key", code="invalid_api_key")

    async def read_json(self, request: Request) -> object:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body is larger than {limit} bytes", code="body_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"request body is larger than {limit} bytes", code="body_too_large")
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"malformed JSON body: {exc}", code="invalid_json") from None

    async def handle(self, request: Request, kind: _Kind) -> Response:
        started = time.perf_counter()
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = {"x-request-id": rid}
        calls: list[grpc.aio.UnaryStreamCall] = []
        try:
            self.check_auth(request)
            req = parse(kind.schema, await self.read_json(request))
            if not self.mesh.knows_model(req.model):
                raise ApiError(404, f"the model {req.model!r} does not exist", param="model", code="model_not_found")
            if self.inflight >= self.config.max_inflight:
                raise ApiError(429, "the gateway is at its concurrency limit; retry shortly", code="overloaded")
            stub = self.mesh.processor_for(req.model)
            if stub is None:
                raise ApiError(503, f"no processor serves {req.model!r} right now", code="unavailable")
            calls = [stub.Generate(msg, timeout=self.config.request_timeout_s) for msg in _processor_requests(rid, req, kind)]
            route = await _first_route(calls)
        except ApiError as exc:
            for call in calls:
                call.cancel()
            self.metrics.requests.labels(kind.endpoint, str(exc.status)).inc()
            if exc.status >= 500 or exc.status == 429:
                log.warning("request %s: %d %s", rid, exc.status, exc.message)
            return exc.response(headers)
        headers["x-kvmesh-worker"] = route.worker_id
        headers["x-kvmesh-prefill"] = prefill_header(route.prefill)
        log.info("request %s: %s %d prompt tokens -> worker %s (%s prefill)", rid, kind.endpoint,
                 route.prompt_tokens, route.worker_id, headers["x-kvmesh-prefill"])
        self.inflight += 1
        self.metrics.inflight.inc()
        stream = _Stream(self, kind, req, rid, calls, started)
        if req.stream:
            return StreamingResponse(stream.sse(), media_type="text/event-stream", headers=headers)
        try:
            body = await stream.collect()
        except ApiError as exc:
            return exc.response(headers)
        return JSONResponse(body, headers=headers)


def _processor_requests(rid: str, req, kind: _Kind) -> list[processor_pb2.GenerateRequest]:
    sampling = common_pb2.SamplingParams(ignore_eos=req.ignore_eos, min_tokens=req.min_tokens)
    if req.token_limit() is not None:
        sampling.max_tokens = req.token_limit()
    for name in ("temperature", "top_p", "top_k", "seed"):
        value = getattr(req, name)
        if value is not None:
            setattr(sampling, name, value)
    if req.logprobs_k() is not None:
        sampling.logprobs = req.logprobs_k()
    base = dict(request_id=rid, model=req.model, sampling=sampling, n=req.n, stop=req.stop_list())
    if kind is CHAT:
        chat = processor_pb2.ChatInput(
            messages=[processor_pb2.ChatMessage(role=m.role, content=m.text(), name=m.name or "") for m in req.messages],
            add_generation_prompt=True)
        return [processor_pb2.GenerateRequest(chat=chat, **base)]
    out = []
    for i, prompt in enumerate(req.prompts()):
        base["request_id"] = rid if i == 0 else f"{rid}-p{i}"
        if isinstance(prompt, str):
            out.append(processor_pb2.GenerateRequest(text=prompt, choice_offset=i * req.n, **base))
        else:
            out.append(processor_pb2.GenerateRequest(tokens=processor_pb2.TokenIds(ids=prompt),
                                                     choice_offset=i * req.n, **base))
    return out


async def _first_route(calls: list[grpc.aio.UnaryStreamCall]) -> processor_pb2.RouteInfo:
    """Each processor stream opens with its RouteInfo; errors before it become HTTP errors."""
    first: processor_pb2.RouteInfo | None = None
    for call in calls:
        try:
            msg = await call.read()
        except grpc.aio.AioRpcError as exc:
            raise from_grpc(exc) from None
        if msg is grpc.aio.EOF or msg.WhichOneof("kind") != "route":
            raise ApiError(503, "the processor closed the stream before routing", code="unavailable")
        first = first or msg.route
    assert first is not None
    return first


async def _messages(call: grpc.aio.UnaryStreamCall) -> AsyncIterator[processor_pb2.GenerateResponse]:
    while True:
        msg = await call.read()
        if msg is grpc.aio.EOF:
            return
        yield msg


class _Stream:
    """The rest of a request after routing: deltas to SSE chunks or one JSON body."""

    def __init__(self, gateway: _Gateway, kind: _Kind, req, rid: str,
                 calls: list[grpc.aio.UnaryStreamCall], started: float) -> None:
        self.gateway = gateway
        self.kind = kind
        self.req = req
        self.calls = calls
        self.started = started
        self.id = kind.id_prefix + rid
        self.created = int(time.time())
        self.usage = processor_pb2.Usage()
        self.status = "200"

    async def _items(self) -> AsyncIterator[processor_pb2.ChoiceDelta]:
        metrics = self.gateway.metrics
        last = None
        try:
            async for msg in merge([_messages(c) for c in self.calls]):
                which = msg.WhichOneof("kind")
                if which == "delta":
                    now = time.perf_counter()
                    if last is None:
                        metrics.ttft.observe(now - self.started)
                    else:
                        metrics.itl.observe(now - last)
                    last = now
                    yield msg.delta
                elif which == "usage":
                    u = self.usage
                    u.prompt_tokens += msg.usage.prompt_tokens
                    u.completion_tokens += msg.usage.completion_tokens
                    u.cached_tokens += msg.usage.cached_tokens
        except grpc.aio.AioRpcError as exc:
            error = from_grpc(exc)
            self.status = str(error.status)
            raise error from None
        finally:
            for call in self.calls:
                call.cancel()
            self.gateway.inflight -= 1
            metrics.inflight.dec()
            metrics.duration.observe(time.perf_counter() - self.started)
            metrics.requests.labels(self.kind.endpoint, self.status).inc()

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        body = {"id": self.id, "object": self.kind.chunk_name, "created": self.created, "model": self.req.model,
                "choices": choices}
        if self.req.include_usage:
            body["usage"] = usage
        return body

    async def sse(self) -> AsyncIterator[bytes]:
        is_chat = self.kind is CHAT
        opened: set[int] = set()
        try:
            async for d in self._items():
                if is_chat:
                    delta: dict = {"content": d.text}
                    if d.index not in opened:
                        opened.add(d.index)
                        delta["role"] = "assistant"
                    choice = {"index": d.index, "delta": delta, "logprobs": chat_logprobs([d]) if d.logprobs else None,
                              "finish_reason": d.finish_reason or None}
                else:
                    choice = {"index": d.index, "text": d.text, "finish_reason": d.finish_reason or None,
                              "logprobs": completion_logprobs([d]) if d.logprobs else None}
                yield sse(self._chunk([choice]))
            if self.req.include_usage:
                yield sse(self._chunk([], usage_body(self.usage)))
        except ApiError as exc:
            yield sse({"error": {"message": exc.message, "type": "server_error", "param": None, "code": exc.code}})
        yield SSE_DONE

    async def collect(self) -> dict:
        choices: dict[int, ChoiceAccumulator] = {}
        async for d in self._items():
            acc = choices.setdefault(d.index, ChoiceAccumulator())
            acc.text.append(d.text)
            if d.logprobs:
                acc.tokens.append(d)
            if d.finish_reason:
                acc.finish_reason = d.finish_reason
        out = []
        for index in sorted(choices):
            acc = choices[index]
            text = "".join(acc.text)
            if self.kind is CHAT:
                out.append({"index": index, "message": {"role": "assistant", "content": text},
                            "logprobs": chat_logprobs(acc.tokens) if self.req.logprobs else None,
                            "finish_reason": acc.finish_reason})
            else:
                out.append({"index": index, "text": text, "finish_reason": acc.finish_reason,
                            "logprobs": completion_logprobs(acc.tokens) if self.req.logprobs is not None else None})
        return {"id": self.id, "object": self.kind.object_name, "created": self.created, "model": self.req.model,
                "choices": out, "usage": usage_body(self.usage)}
