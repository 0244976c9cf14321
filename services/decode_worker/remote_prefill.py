"""Getting a prompt prefilled on the prefill pool, or deciding not to.

The decode worker asks the router for the best prefill worker (KV-aware over the prefill pool,
which also reports the pool's queue), applies the disaggregation rule, and calls that worker's
prefill with a deadline, over the session to it (`Prefiller.Session`: frames, outcomes,
deadlines and cancellation as on every other hop). Whatever goes wrong on the way — no prefill
worker, an error, the deadline — the answer is "prefill locally": logged at WARNING and counted
as a fallback under the reason the outcome table gives (services/contract/outcomes.py, hop
PREFILL), which also says which prefill workers to set aside for a while.

A prompt worth prefilling remotely is traced as a `remote prefill` span: the router's `route`
span and the prefill worker's `prefill` span sit under it, and a fallback is an error on it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gen.kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.contract.outcomes import Hop, fallback_reason, verdict
from services.decode_worker.disagg_decision import DisaggConfig, absolute_prefill_length, prefill_remote, worth_remote
from services.mesh.channels import ChannelPool
from services.mesh.hop_latency import hop_latency_histogram
from services.mesh.recent_failures import RecentFailures
from services.mesh.session_client import SessionPool
from services.mesh.session_kind import PREFILL_SESSION, CallError
from services.mesh.tracing import TRACING_OFF, Tracing, outgoing_metadata
from services.routing.router_client import NoWorkerError, RouterClient, RoutingError
from services.worker.kv_pull import kv_pull_from_proto

log = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 2.0


class DisaggMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.remote = Counter("kvmesh_decode_remote_prefill", "requests prefilled on a prefill worker", registry=registry)
        self.local = Counter("kvmesh_decode_local_prefill", "requests prefilled on this decode worker", registry=registry)
        # What the planner sizes the pools by: the prompt work each pool was given.
        self.remote_tokens = Counter("kvmesh_decode_remote_prefill_tokens",
                                     "uncached prompt tokens (the router's estimate) prefilled on a prefill worker",
                                     registry=registry)
        self.local_tokens = Counter("kvmesh_decode_local_prefill_tokens",
                                    "uncached prompt tokens (the router's estimate) prefilled on this decode worker",
                                    registry=registry)
        self.fallback = Counter("kvmesh_decode_prefill_fallback",
                                "remote prefills that failed and ran locally instead", ["reason"], registry=registry)
        # What this process adds to a streamed token's latency (hop_latency.py).
        self.hops = hop_latency_histogram(registry)
        self.queue = Gauge("kvmesh_prefill_queue_size", "waiting requests across the prefill pool, as last seen",
                           registry=registry)
        self.transfer_bytes = Counter("kvmesh_kv_transfer_bytes", "KV cache bytes received from prefill workers",
                                      registry=registry)
        self.transfer_seconds = Histogram(
            "kvmesh_kv_transfer_duration_seconds", "duration of each KV cache transfer", registry=registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))

    def prefilled(self, remote: bool, uncached_tokens: int) -> None:
        """Counts where one request's prompt was prefilled (a remote prefill whose KV turned out
        unusable after it finished counts on both sides)."""
        (self.remote if remote else self.local).inc()
        (self.remote_tokens if remote else self.local_tokens).inc(uncached_tokens)

    def record_transfer(self, nbytes: int, seconds: float) -> None:
        """The engine's report of one KV transfer (its KV transfer sink). Also put on the current
        span: an engine that reports within the request (the mocker) does so inside the request's
        `kv transfer` span; vLLM reports from its stats loop, where no span is current."""
        self.transfer_bytes.inc(nbytes)
        self.transfer_seconds.observe(seconds)
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attributes({"kvmesh.kv_transfer.bytes": nbytes, "kvmesh.kv_transfer.seconds": seconds})


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """KV computed elsewhere to decode from: a prefill worker's, or (`moved`) the KV a draining
    decode worker handed over with the request (worker/handoff.py)."""

    worker_id: str
    address: str
    # What the decode engine needs to pull the KV (EngineRequest.kv_pull).
    kv_pull: dict[str, Any]
    moved: bool = False


class RemotePrefiller:
    def __init__(self, config: DisaggConfig, model: str, routers: RouterClient, sessions: SessionPool,
                 channels: ChannelPool, metrics: DisaggMetrics, tracing: Tracing = TRACING_OFF) -> None:
        self.config = config
        self._tracing = tracing
        self._model = model
        self._routers = routers
        self._sessions = sessions
        self._channels = channels
        self.metrics = metrics
        self._failed = RecentFailures()

    async def plan(self, rid: str, tokens: list[int], sampling: common_pb2.SamplingParams,
                   prefix_hit_rate: float, lora_name: str = "",
                   media: Sequence[common_pb2.MediaItem] = ()) -> RemotePrefill | None:
        """A finished remote prefill to decode from, or None for a local prefill. `lora_name`: the
        LoRA adapter the request runs with; the router picks a prefill worker that knows it, and
        one that does not refuses the prefill (the decode worker prefills locally). `media`: the
        prompt's images, which the prefill worker encodes with the prompt."""
        remote = None
        if worth_remote(len(tokens), prefix_hit_rate, self.config):
            with self._tracing.span("remote prefill", SpanKind.CLIENT) as span:
                remote = await self._remote(rid, tokens, sampling, prefix_hit_rate, lora_name, media, span)
        self.metrics.prefilled(remote is not None, absolute_prefill_length(len(tokens), prefix_hit_rate))
        return remote

    async def _remote(self, rid: str, tokens: list[int], sampling: common_pb2.SamplingParams,
                      prefix_hit_rate: float, lora_name: str, media: Sequence[common_pb2.MediaItem],
                      span: Span) -> RemotePrefill | None:
        try:
            route = await self._routers.route(rid, self._model, tokens, common_pb2.WORKER_ROLE_PREFILL,
                                              exclude=self._failed.current(), lora_name=lora_name,
                                              media=[item.span for item in media])
        except NoWorkerError as exc:
            self.fallback(rid, "no_prefill_worker", str(exc), span)
            return None
        except RoutingError as exc:
            self.fallback(rid, "no_router", str(exc), span)
            return None
        self.metrics.queue.set(route.pool_waiting)
        if not prefill_remote(len(tokens), prefix_hit_rate, route.pool_waiting, self.config):
            log.info("request %s: prefill queue %d >= %d; prefilling locally", rid, route.pool_waiting,
                     self.config.max_prefill_queue_size)
            if span.is_recording():
                span.set_attributes({"kvmesh.prefill.site": "local", "kvmesh.prefill.queue": route.pool_waiting})
            return None
        if span.is_recording():
            span.set_attributes({"kvmesh.request_id": rid, "kvmesh.prefill_worker_id": route.worker_id,
                                 "kvmesh.prompt_tokens": len(tokens), "kvmesh.lora_name": lora_name})
        session = self._sessions.get(PREFILL_SESSION, route.address)
        try:
            reply = await session.call(worker_pb2.PrefillRequest(request_id=rid, token_ids=tokens, sampling=sampling,
                                                                 lora_name=lora_name, media=media),
                                       self.config.prefill_timeout_s, outgoing_metadata())
        except CallError as exc:
            judged = verdict(Hop.PREFILL, exc.outcome)
            if judged.set_aside:
                self._failed.add(route.worker_id)
            self.fallback(rid, fallback_reason(exc.outcome),
                          f"prefill worker {route.worker_id}: {exc.outcome_name} {exc.message}", span)
            return None
        log.info("request %s: %d tokens prefilled remotely on %s (%d cached there)", rid, len(tokens),
                 route.worker_id, reply.cached_tokens)
        return RemotePrefill(route.worker_id, route.address, kv_pull_from_proto(reply.kv_pull))

    def fallback(self, rid: str, reason: str, detail: str, span: Span = trace.INVALID_SPAN) -> None:
        """Counts and logs a remote prefill given up for a local one; `span`, the remote prefill's,
        is marked failed (the request itself goes on)."""
        log.warning("request %s: remote prefill failed (%s); prefilling locally", rid, detail)
        self.metrics.fallback.labels(reason).inc()
        if span.is_recording():
            span.set_attributes({"kvmesh.prefill.site": "local", "kvmesh.prefill.fallback": reason})
            span.set_status(Status(StatusCode.ERROR, detail))

    async def release(self, rid: str, remote: RemotePrefill) -> None:
        """Best effort: tell the prefill worker to free KV this worker will not pull."""
        stub = worker_pb2_grpc.PrefillerStub(self._channels.get(remote.address))
        try:
            await stub.ReleaseKv(worker_pb2.ReleaseKvRequest(request_id=rid), timeout=RELEASE_TIMEOUT_S,
                                 metadata=outgoing_metadata())
        except grpc.aio.AioRpcError as exc:
            log.info("request %s: could not release KV on %s (%s); it expires there", rid, remote.worker_id,
                     exc.code().name)
