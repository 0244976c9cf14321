"""OpenTelemetry tracing for one process: off unless the standard `OTEL_*` environment asks for it.

Rules:
- On only when `OTEL_TRACES_EXPORTER` names exporters (`otlp`, `console`, comma-separated) or, with
  it unset, when an OTLP endpoint is given (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
  `OTEL_EXPORTER_OTLP_ENDPOINT`). `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` turns it
  off whatever else is set. (Narrower than the spec's default exporter, `otlp`: a mesh started
  with no OTEL_* at all must not dial localhost:4317 from every process.)
- OTLP goes over `grpc` (the Python SDK's default) or `http/protobuf`, from
  `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` / `OTEL_EXPORTER_OTLP_PROTOCOL`. The rest the SDK reads
  itself: endpoint, headers, timeout and TLS of the exporter, `OTEL_BSP_*` of the batch processor,
  `OTEL_TRACES_SAMPLER` (parent-based always-on by default: a client's unsampled traceparent is
  honoured) and `OTEL_RESOURCE_ATTRIBUTES`.
- `service.name` is the component (`frontend`, `processor`, `kv-router`, `decode-worker`,
  `prefill-worker`) unless `OTEL_SERVICE_NAME` is set; `kvmesh.component` always is.
- Off costs nothing measurable on the hot path: spans are a shared `nullcontext` holding the
  invalid span (no attributes are built for a span that does not record), servers extract no
  context, and `outgoing_metadata()` finds no valid span and returns None.
- The provider belongs to the process, not to the OpenTelemetry API's global: each service hands
  its `Tracing` to what it builds, and the service runner shuts it down last, so spans that end
  during a drain are still exported.

Trace context crosses every gRPC hop as W3C `traceparent` / `tracestate` call metadata: a caller
passes `metadata=outgoing_metadata()` on each call, a server opens its span with `server_span`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import INVALID_SPAN, NoOpTracer, Span, SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from services.config_error import ConfigError
from services.mesh.config_error import validated
from services.mesh.session_kind import CallInfo

if TYPE_CHECKING:
    import grpc
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger(__name__)


class TeardownOwner(Protocol):
    """What starts tracing: a process's runner (service_runner.ServiceRunner), which shuts it down."""

    component: str

    def on_teardown(self, label: str, action: Callable[[], Awaitable[None]], timeout_s: float = ...) -> None: ...

# The only metadata keys trace context travels in (W3C Trace Context, lower case as gRPC requires).
TRACE_KEYS = ("traceparent", "tracestate")
EXPORTERS = ("otlp", "console")
OTLP_PROTOCOLS = ("grpc", "http/protobuf")
# What a process waits at exit for its last spans to go out: a collector that does not answer must
# not hold a drain (the exporter's own timeout is 10 s and retries).
SHUTDOWN_TIMEOUT_S = 5.0

# Stateless: one instance serves every process and request.
_PROPAGATOR = TraceContextTextMapPropagator()


@dataclass(frozen=True, slots=True)
class TracingSettings:
    """What the OTEL_* environment asks for; no exporters means tracing is off."""

    exporters: tuple[str, ...] = ()
    protocol: str = "grpc"

    @property
    def enabled(self) -> bool:
        return bool(self.exporters)


def settings_from_env(env: Mapping[str, str]) -> TracingSettings:
    """The settings the rules in the module docstring derive; ConfigError for an exporter or
    protocol kvmesh cannot build."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return TracingSettings()
    named = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if named:
        names = tuple(dict.fromkeys(n.strip() for n in named.split(",") if n.strip()))
        if "none" in names:
            return TracingSettings()
        unknown = [n for n in names if n not in EXPORTERS]
        if unknown:
            raise ConfigError(f"OTEL_TRACES_EXPORTER: {', '.join(unknown)} not supported (use {', '.join(EXPORTERS)} "
                              "or none)")
        exporters = names
    elif env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        exporters = ("otlp",)
    else:
        return TracingSettings()
    variable = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" if env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") \
        else "OTEL_EXPORTER_OTLP_PROTOCOL"
    protocol = (env.get(variable) or "grpc").strip().lower()
    if "otlp" in exporters and protocol not in OTLP_PROTOCOLS:
        raise ConfigError(f"{variable}: {protocol!r} not supported (use {' or '.join(OTLP_PROTOCOLS)})")
    return TracingSettings(exporters, protocol)


class Tracing:
    """One process's tracer, and the trace context of its gRPC and HTTP servers."""

    def __init__(self, tracer: Tracer, provider: TracerProvider | None = None) -> None:
        self.tracer = tracer
        self._provider = provider
        # Checked before any work that exists only for a trace (extracting a parent, attributes).
        self.enabled = provider is not None

    def server_span(self, name: str, context: grpc.aio.ServicerContext | CallInfo,
                    rpc: str) -> AbstractContextManager[Span]:
        """The span of one gRPC call this process serves (a per-request RPC's context, or a call
        on a session), under the caller's trace context.

        `rpc` is the method's full name (`kvmesh.v1.Router/Route`). An exception escaping the
        block is recorded on the span and marks it failed; a cancellation (the caller left) is not."""
        if not self.enabled:
            return _NO_SPAN
        service, _, method = rpc.rpartition("/")
        return self.tracer.start_as_current_span(
            name, context=_extract(context.metadata.items() if isinstance(context, CallInfo)
                                   else context.invocation_metadata() or ()), kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method})

    def span(self, name: str, kind: SpanKind = SpanKind.INTERNAL) -> AbstractContextManager[Span]:
        """A span under the current one, current inside the block (errors recorded as above)."""
        if not self.enabled:
            return _NO_SPAN
        return self.tracer.start_as_current_span(name, kind=kind)

    def http_parent(self, headers: Iterable[tuple[bytes, bytes]]) -> Context | None:
        """The trace context of an HTTP request's `traceparent` / `tracestate` (ASGI header pairs)."""
        return _PROPAGATOR.extract({k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers
                                    if k.lower() in (b"traceparent", b"tracestate")})

    async def shutdown(self) -> None:
        """Exports the spans still queued, then stops the exporters; safe to call twice.

        On a daemon thread, waited for at most SHUTDOWN_TIMEOUT_S: the SDK's shutdown blocks for
        as long as its exporter retries, and a process must exit even when the collector is gone."""
        provider, self._provider = self._provider, None
        if provider is None:
            return
        done = threading.Event()

        def flush_and_stop() -> None:
            try:
                provider.force_flush(int(SHUTDOWN_TIMEOUT_S * 1000))
                provider.shutdown()
            finally:
                done.set()

        threading.Thread(target=flush_and_stop, name="otel-shutdown", daemon=True).start()
        if not await asyncio.to_thread(done.wait, SHUTDOWN_TIMEOUT_S):
            log.warning("traces not exported within %.0fs at shutdown; dropped", SHUTDOWN_TIMEOUT_S)


TRACING_OFF = Tracing(NoOpTracer())
# What an off process enters instead of a span: reusable, it holds no state.
_NO_SPAN: AbstractContextManager[Span] = nullcontext(INVALID_SPAN)


def outgoing_metadata() -> tuple[tuple[str, str], ...] | None:
    """gRPC call metadata carrying the current span's trace context; None when there is no span
    (tracing off in this process, or a call made outside any request)."""
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return tuple(carrier.items())


def _extract(metadata: Iterable[tuple[str, str | bytes]]) -> Context:
    return _PROPAGATOR.extract({k: v for k, v in metadata if k in TRACE_KEYS and isinstance(v, str)})


def build_tracing(component: str, env: Mapping[str, str] | None = None) -> Tracing:
    """The process's tracing from the environment; TRACING_OFF unless it asks for export."""
    environment = os.environ if env is None else env
    settings = settings_from_env(environment)
    if not settings.enabled:
        return TRACING_OFF
    # The SDK and exporters load only when used: a process that does not trace does not pay for them.
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes: dict[str, str] = {"kvmesh.component": component}
    if not environment.get("OTEL_SERVICE_NAME"):
        # Resource.create lets these override OTEL_* settings, so service.name goes in only when
        # OTEL_SERVICE_NAME does not name the service itself.
        attributes[SERVICE_NAME] = component
    provider = TracerProvider(resource=Resource.create(attributes), shutdown_on_exit=False)
    for name in settings.exporters:
        provider.add_span_processor(BatchSpanProcessor(_exporter(name, settings.protocol)))
    log.info("tracing on: %s", ", ".join(f"otlp/{settings.protocol}" if n == "otlp" else n for n in settings.exporters))
    return Tracing(provider.get_tracer("kvmesh"), provider)


def _exporter(name: str, protocol: str) -> SpanExporter:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def start_tracing(runner: TeardownOwner) -> Tracing:
    """The process's tracing, shut down by the runner after everything acquired later: call it
    first in `assemble`. A bad OTEL_* setting exits like a bad flag."""
    tracing = validated(lambda: build_tracing(runner.component))
    runner.on_teardown("export the last traces", tracing.shutdown, SHUTDOWN_TIMEOUT_S + 1)
    return tracing
