"""One request is one trace across every service, under the client's W3C traceparent.

The environment rules and the gRPC propagation are checked in-process; then a real disaggregated
mocker mesh (router, processor, frontend, a decode worker that prefills long prompts remotely, a
prefill worker, KV over NIXL) exports over OTLP/gRPC to a collector this test runs itself, and the
spans of one request must form the documented tree (services/mesh/tracing.py and README "Tracing").
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2 as otlp_common
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.config_error import ConfigError
from services.mesh.tracing import TRACING_OFF, Tracing, TracingSettings, build_tracing, outgoing_metadata, settings_from_env
from tests.procs import MODEL, Etcd, ServiceMesh, wait_until
from tests.e2e.test_disagg_mocker import router_serves_prefill_pool

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
BYTES_PER_TOKEN = 2048
NIXL = ("--kv-transfer", "nixl", "--kv-bytes-per-token", str(BYTES_PER_TOKEN))
PROMPT_TOKENS = 1000  # well over --max-local-prefill-length: prefilled remotely
SPANS_WAIT_S = 20.0


# -- the environment --------------------------------------------------------------------------

ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}


@pytest.mark.parametrize(("env", "expected"), [
    ({}, TracingSettings()),  # nothing asked: off, nothing dialled
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, TracingSettings()),  # a protocol alone exports nowhere
    (ENDPOINT, TracingSettings(("otlp",), "grpc")),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
     TracingSettings(("otlp",), "http/protobuf")),
    ({**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"},
     TracingSettings(("otlp",), "http/protobuf")),  # the traces-specific variable wins
    ({"OTEL_TRACES_EXPORTER": "console"}, TracingSettings(("console",), "grpc")),
    ({"OTEL_TRACES_EXPORTER": "otlp, console"}, TracingSettings(("otlp", "console"), "grpc")),
    ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "none"}, TracingSettings()),
    ({**ENDPOINT, "OTEL_SDK_DISABLED": "true"}, TracingSettings()),
    ({**ENDPOINT, "OTEL_SDK_DISABLED": "false"}, TracingSettings(("otlp",), "grpc")),
])
def test_tracing_is_on_only_when_the_environment_asks_for_an_exporter(env: dict[str, str],
                                                                      expected: TracingSettings) -> None:
    assert settings_from_env(env) == expected


@pytest.mark.parametrize("env", [{"OTEL_TRACES_EXPORTER": "zipkin"},
                                 {**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}])
def test_an_exporter_kvmesh_cannot_build_is_a_config_error(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        settings_from_env(env)


@pytest.mark.parametrize(("service_name", "expected"), [(None, "kv-router"), ("my-router", "my-router")])
async def test_the_service_is_named_after_the_component_unless_otel_service_name_says_otherwise(
        monkeypatch: pytest.MonkeyPatch, service_name: str | None, expected: str) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    if service_name is None:
        monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    else:
        monkeypatch.setenv("OTEL_SERVICE_NAME", service_name)
    tracing = build_tracing("kv-router")
    try:
        assert tracing.enabled
        resource = tracing.tracer.resource  # type: ignore[attr-defined]
        assert resource.attributes["service.name"] == expected
        assert resource.attributes["kvmesh.component"] == "kv-router"
    finally:
        await tracing.shutdown()
        await tracing.shutdown()  # twice is harmless


def test_without_otel_settings_the_process_gets_the_no_op_tracing() -> None:
    tracing = build_tracing("processor", {})
    assert tracing is TRACING_OFF and not tracing.enabled
    with tracing.tracer.start_as_current_span("tokenize") as span:
        assert not span.is_recording()
        assert outgoing_metadata() is None  # nothing rides along on the calls either


# -- propagation over gRPC metadata, in-process -----------------------------------------------


@dataclass
class FakeServicerContext:
    metadata: tuple[tuple[str, str], ...]

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata


def test_a_server_span_continues_the_trace_of_the_calls_metadata() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = Tracing(provider.get_tracer("test"), provider)
    context = FakeServicerContext((("traceparent", TRACEPARENT), ("x-other", "1")))
    with tracing.server_span("route", context, "kvmesh.v1.Router/Route") as span:  # type: ignore[arg-type]
        metadata = dict(outgoing_metadata() or ())
    (finished,) = exporter.get_finished_spans()
    assert finished.context == span.get_span_context() and finished.name == "route"
    assert format(finished.context.trace_id, "032x") == CLIENT_TRACE_ID
    assert finished.parent is not None and format(finished.parent.span_id, "016x") == CLIENT_SPAN_ID
    assert dict(finished.attributes or {}) == {"rpc.system": "grpc", "rpc.service": "kvmesh.v1.Router",
                                               "rpc.method": "Route"}
    # The next hop's parent is this span.
    assert metadata["traceparent"] == f"00-{CLIENT_TRACE_ID}-{format(finished.context.span_id, '016x')}-01"


# -- a real mesh ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Collected:
    service: str
    span: trace_pb2.Span

    @property
    def trace_id(self) -> str:
        return self.span.trace_id.hex()

    @property
    def span_id(self) -> str:
        return self.span.span_id.hex()

    @property
    def parent_id(self) -> str:
        return self.span.parent_span_id.hex()

    def attribute(self, key: str) -> object:
        return _attributes(self.span.attributes).get(key)


def _attributes(kvs: list[otlp_common.KeyValue]) -> dict[str, object]:
    out: dict[str, object] = {}
    for kv in kvs:
        which = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, which) if which else None
    return out


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[Collected] = []
        self._lock = threading.Lock()

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,  # noqa: N802
               context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        with self._lock:
            for resource_spans in request.resource_spans:
                service = str(_attributes(resource_spans.resource.attributes).get("service.name"))
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend(Collected(service, s) for s in scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[Collected]:
        with self._lock:
            return list(self.spans)


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Collector, int]]:
    servicer = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(0)


@pytest.fixture(scope="module")
def traced_mesh(etcd: Etcd, collector: tuple[Collector, int]) -> Iterator[ServiceMesh]:
    """Every service exports to the collector; the decode worker prefills long prompts remotely."""
    _, port = collector
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    mesh = ServiceMesh(etcd.endpoint, env=env)
    try:
        mesh.worker(*NIXL, "--remote-prefill", "--max-local-prefill-length", "256", "--prefill-timeout", "10",
                    "--max-prefill-queue-size", "64")
        mesh.prefill_worker(*NIXL)
        assert wait_until(lambda: router_serves_prefill_pool(mesh), 20), "the router never saw the prefill worker"
        yield mesh
    finally:
        mesh.stop()


EXPECTED_NAMES = {"POST /v1/completions", "generate", "tokenize", "route", "decode", "remote prefill", "prefill",
                  "kv transfer"}


def spans_of_the_request(collector: Collector) -> list[Collected]:
    """Waits (bounded) until every expected span has arrived; returns all spans collected."""
    def complete() -> bool:
        names = [s.span.name for s in collector.snapshot()]
        return EXPECTED_NAMES <= set(names) and names.count("route") >= 2

    assert wait_until(complete, SPANS_WAIT_S), f"spans so far: {[s.span.name for s in collector.snapshot()]}"
    # Anything still on its way (nothing should be) is caught by the trace id check: wait until
    # the collector has been quiet for one poll.
    seen = [len(collector.snapshot())]

    def quiet() -> bool:
        seen.append(len(collector.snapshot()))
        return seen[-1] == seen[-2]

    wait_until(quiet, 5, interval_s=0.25)
    return collector.snapshot()


def test_one_request_is_one_trace_across_every_service(traced_mesh: ServiceMesh,
                                                       collector: tuple[Collector, int]) -> None:
    rng = random.Random(7)
    prompt = [rng.randrange(20, 1000) for _ in range(PROMPT_TOKENS)]
    r = httpx.post(traced_mesh.url("/v1/completions"), json={"model": MODEL, "prompt": prompt, "max_tokens": 4},
                   headers={"traceparent": TRACEPARENT}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["x-kvmesh-prefill"].startswith("remote:"), "the prompt was to be prefilled remotely"
    spans = spans_of_the_request(collector[0])

    # Every span is the client's trace, and every service took part.
    assert {s.trace_id for s in spans} == {CLIENT_TRACE_ID}
    assert {s.service for s in spans} == {"frontend", "processor", "kv-router", "decode-worker", "prefill-worker"}

    def one(name: str, service: str, **attributes: object) -> Collected:
        found = [s for s in spans if s.span.name == name and s.service == service
                 and all(s.attribute(k) == v for k, v in attributes.items())]
        assert len(found) == 1, f"{name} on {service} {attributes}: {[(s.span.name, s.service) for s in spans]}"
        return found[0]

    http = one("POST /v1/completions", "frontend")
    generate = one("generate", "processor")
    tokenize = one("tokenize", "processor")
    route = one("route", "kv-router", **{"kvmesh.route.pool": "decode-worker"})
    decode = one("decode", "decode-worker")
    remote = one("remote prefill", "decode-worker")
    prefill_route = one("route", "kv-router", **{"kvmesh.route.pool": "prefill-worker"})
    prefill = one("prefill", "prefill-worker")
    transfer = one("kv transfer", "decode-worker")

    # The tree: client -> frontend -> processor -> {tokenize, route, decode -> {remote prefill ->
    # {route, prefill}, kv transfer}}.
    assert http.parent_id == CLIENT_SPAN_ID
    for child, parent in [(generate, http), (tokenize, generate), (route, generate), (decode, generate),
                          (remote, decode), (prefill_route, remote), (prefill, remote), (transfer, decode)]:
        assert child.parent_id == parent.span_id, f"{child.span.name} is not under {parent.span.name}"
    server, client = trace_pb2.Span.SPAN_KIND_SERVER, trace_pb2.Span.SPAN_KIND_CLIENT
    assert [s.span.kind for s in (http, generate, route, decode, prefill_route, prefill)] == [server] * 6
    assert remote.span.kind == client

    # What the spans say: where the request ran and why, and what crossed the wire.
    worker = r.headers["x-kvmesh-worker"]
    assert http.attribute("http.response.status_code") == 200 and http.attribute("kvmesh.worker_id") == worker
    assert route.attribute("kvmesh.route.worker_id") == worker == decode.attribute("kvmesh.worker_id")
    for key in ("overlap_blocks", "cache_usage", "waiting", "logit"):
        assert route.attribute(f"kvmesh.route.{key}") is not None
    assert tokenize.attribute("kvmesh.prompt_tokens") == PROMPT_TOKENS
    assert remote.attribute("kvmesh.prefill_worker_id") == r.headers["x-kvmesh-prefill"].removeprefix("remote:")
    assert transfer.attribute("kvmesh.kv_transfer.bytes") == PROMPT_TOKENS * BYTES_PER_TOKEN
    assert all(s.span.status.code != trace_pb2.Status.STATUS_CODE_ERROR for s in spans)
    # Children lie within their parents' time (where the parent waits for the child's answer).
    for child, parent in [(generate, http), (prefill, remote), (transfer, decode)]:
        assert parent.span.start_time_unix_nano <= child.span.start_time_unix_nano
        assert child.span.end_time_unix_nano <= parent.span.end_time_unix_nano
