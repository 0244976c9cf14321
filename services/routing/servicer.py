"""The router's gRPC service: picks a worker for each tokenized prompt, with the picker of the
mode it was started in, and reports the chosen worker's cached prefix whatever the mode.

`kv` mode scores every eligible worker with the cost function (cached prefix vs load); with no
cached prefix anywhere that reduces to least-loaded. `round-robin` and `random` ignore the
cache for the choice but still report the chosen worker's overlap, which the decode worker's
disaggregation decision uses (services/routing/pickers/ holds the modes).

No eligible worker is NOT_FOUND, not UNAVAILABLE: every router sees the same pools, so another
router would answer the same, and a caller must not retry the request elsewhere.

Each decision can say why (explanation.py): in the `route` span when traced, in a DEBUG log line,
and in the response when the caller set `explain`.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
from opentelemetry.trace import Span
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gen.kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.routing.cost_function import CostWeights, overlap_ratio
from services.routing.explanation import explain
from services.routing.host_credit import host_credit
from services.routing.pickers import ROUTER_MODES as ROUTER_MODES
from services.routing.pickers import PickContext, make_picker
from services.routing.admission.gate import Admission, Queued, Ticket
from services.routing.worker_pool import WorkerPool, WorkerState
from services.mesh.flags import ConfigError
from services.kv_protocol.hashing import local_block_hashes
from services.mesh.grpc_server import abort_with, as_unary_rpc
from services.mesh.session_kind import ROUTER_SESSION, CallError, CallInfo, call_info, final_error
from services.mesh.session_server import SessionHub
from services.mesh.tracing import TRACING_OFF, Tracing
from services.mesh.logs import REQUEST_ID

log = logging.getLogger(__name__)

ROUTE_RPC = "kvmesh.v1.Router/Route"


@dataclass(frozen=True)
class RouterConfig:
    mode: str = "kv"
    seed: int | None = None
    weights: CostWeights = field(default_factory=CostWeights)

    def __post_init__(self) -> None:
        if self.mode not in ROUTER_MODES:
            raise ConfigError(f"--router-mode {self.mode!r} is not one of {', '.join(ROUTER_MODES)}")
        if self.weights.temperature < 0:
            raise ConfigError(f"--router-temperature must be >= 0, got {self.weights.temperature}")
        host = self.weights.host_overlap
        if host is not None and not 0 <= host <= 1:
            raise ConfigError(f"--host-overlap-weight must be within 0..1 (a host hit is worth at most a device "
                              f"hit), got {host}")


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decision_seconds = Histogram(
            "kvmesh_router_decision_latency_seconds", "time to pick a worker", registry=registry,
            buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05),
        )
        self.routed = Counter("kvmesh_router_routed_requests", "requests routed, per worker",
                              ["worker_id", "role"], registry=registry)
        self.no_worker = Counter("kvmesh_router_no_worker", "route requests with no eligible worker", registry=registry)
        self.hit_rate = Gauge("kvmesh_router_kv_hit_rate",
                              "share of routed prompt tokens already cached on the chosen worker", registry=registry)
        self.prompt_tokens = Counter("kvmesh_router_prompt_tokens", "prompt tokens routed", registry=registry)
        self.overlap_tokens = Counter("kvmesh_router_overlap_tokens", "routed prompt tokens cached on the chosen worker",
                                      registry=registry)
        self._totals = [0, 0]

    def record(self, prompt_tokens: int, overlap_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.overlap_tokens.inc(overlap_tokens)
        self._totals[0] += prompt_tokens
        self._totals[1] += overlap_tokens
        self.hit_rate.set(self._totals[1] / self._totals[0] if self._totals[0] else 0.0)


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, pools: dict[int, WorkerPool], config: RouterConfig, metrics: RouterMetrics,
                 tracing: Tracing = TRACING_OFF, admission: Admission | None = None) -> None:
        self._pools = pools
        # The decode pool's queue and admission: for calls that `hold` (gate.py).
        self.admission = admission
        self._metrics = metrics
        self._mode = config.mode
        self._tracing = tracing
        # One generator for every random draw of the router, so a seed fixes all its choices.
        self._picker = make_picker(config.mode, random.Random(config.seed), config.weights)
        self._host_weight = config.weights.host_overlap

        # Callers' sessions: every routing they ask for, served by `route`.
        self.sessions = SessionHub(ROUTER_SESSION, self.route)
        if admission is not None:
            self.sessions.on_drain(admission.drain)

    def _pool(self, role: int) -> WorkerPool:
        pool = self._pools.get(role or common_pb2.WORKER_ROLE_DECODE)
        if pool is None:
            raise final_error(grpc.StatusCode.INVALID_ARGUMENT, f"unknown worker role {role}")
        return pool

    async def Route(self, request: router_pb2.RouteRequest, context: grpc.aio.ServicerContext) -> router_pb2.RouteResponse:  # noqa: N802
        if request.hold:
            # A unary call ends with its reply: it can hold no place (admission needs a session).
            await abort_with(context, final_error(grpc.StatusCode.INVALID_ARGUMENT,
                                                  "hold needs a call on Router.Session, not Route"))
        return await as_unary_rpc(context, self.route(request, call_info(context)))

    async def Session(self, frames: AsyncIterator[router_pb2.RouterSessionDown],  # noqa: N802
                      context: grpc.aio.ServicerContext) -> None:
        await self.sessions.serve(frames, context)

    async def route(self, request: router_pb2.RouteRequest, call: CallInfo) -> AsyncIterator[router_pb2.RouteResponse]:
        """One routing decision, for `Route` and for a call on a session alike. A call that
        `holds` is admitted first (it may wait, or be refused), and stays open after its reply
        until the caller ends it: its place on the worker is given back then."""
        REQUEST_ID.set(request.request_id)  # this call's task: its log lines carry the id
        if not self._admits(request):
            with self._tracing.server_span("route", call, ROUTE_RPC) as span:
                yield self.decide(request, span)
            return
        assert self.admission is not None
        with self._tracing.server_span("route", call, ROUTE_RPC) as span:
            self._candidates(request)  # no worker at all: refused at once, not queued
            started = self.admission.begin(request)
            if isinstance(started, Queued):
                try:
                    yield router_pb2.RouteResponse(queued=True)
                except BaseException:
                    self.admission.abandon(started)  # closed here: it never began to wait
                    raise
                started = await self.admission.wait(started)
            reply = self._placed(request, span, started)
        try:
            yield reply
            # Until the caller ends the call, or this router drains: its places go with it, and
            # a router that is going away has no reason to keep a request's stream waiting.
            await self.sessions.drained.wait()
        finally:
            started.release()

    def _admits(self, request: router_pb2.RouteRequest) -> bool:
        return (request.hold and self.admission is not None
                and (request.role or common_pb2.WORKER_ROLE_DECODE) == common_pb2.WORKER_ROLE_DECODE)

    async def admit(self, request: router_pb2.RouteRequest) -> tuple[router_pb2.RouteResponse, Ticket]:
        """Admits the request (waiting for room, or refused), then decides among the workers
        with room; the ticket is the caller's to release at the request's end (in-process)."""
        assert self.admission is not None
        with self._tracing.span("route") as span:
            self._candidates(request)
            ticket = await self.admission.enter(request)
            return self._placed(request, span, ticket), ticket

    def _placed(self, request: router_pb2.RouteRequest, span: Span, ticket: Ticket) -> router_pb2.RouteResponse:
        try:
            reply = self.decide(request, span, ticket.eligible)
        except BaseException:
            ticket.release()
            raise
        ticket.placed(reply.worker_id)
        reply.queue_wait_ms = round(ticket.waited_s * 1000)
        return reply

    def _candidates(self, request: router_pb2.RouteRequest) -> tuple[WorkerPool, list[WorkerState]]:
        """The request's pool and its workers serving the model, less the excluded; NOT_FOUND
        when none is left."""
        pool = self._pool(request.role)
        excluded = set(request.exclude_worker_ids)
        candidates = [w for w in pool.candidates(request.model) if w.info.instance_id not in excluded]
        if not candidates:
            self._metrics.no_worker.inc()
            raise final_error(grpc.StatusCode.NOT_FOUND, f"no {pool.view.component} serves model {request.model!r}")
        return pool, candidates

    def decide(self, request: router_pb2.RouteRequest, span: Span,
               eligible: Callable[[WorkerState], bool] | None = None) -> router_pb2.RouteResponse:
        """One decision, synchronously (also what an in-process router calls). `eligible`: the
        workers an admitted request may take (those with room), when any is."""
        started = time.perf_counter()
        pool, candidates = self._candidates(request)
        if eligible is not None:
            candidates = [w for w in candidates if eligible(w)] or candidates
        block_size = pool.block_size(request.model) or candidates[0].info.block_size
        tokens = request.token_ids
        overlaps, host_overlaps = pool.index.find_matches_by_tier(local_block_hashes(tokens, block_size))
        pick_context = PickContext(overlaps, block_size, len(tokens), pool.index.block_count, host_overlaps)
        chosen = self._picker.pick(candidates, pick_context)
        # Explained only when someone looks: the terms cost a second pass over the candidates. Taken
        # before the pending work below is added, so they are the numbers the pick weighed.
        explanation = None
        if request.explain or span.is_recording() or log.isEnabledFor(logging.DEBUG):
            explanation = explain(self._mode, chosen.info.instance_id, self._picker.terms(candidates, pick_context))
        # The pool's queue as this request finds it (the disaggregation rule's prefill queue size).
        pool_waiting = sum(w.load.num_requests_waiting + len(w.pending) for w in candidates)
        overlap = overlaps.get(chosen.info.instance_id, 0)
        host_overlap = host_overlaps.get(chosen.info.instance_id, 0)
        prompt_blocks = -(-len(tokens) // block_size)
        # Blocks loaded back from host memory take device blocks as recomputed ones do.
        chosen.add_pending(max(0, prompt_blocks - overlap))
        # What the prompt need not compute (the disaggregation rule's input): a host-held block
        # counts as much as the cost function credits it.
        credit = host_credit(chosen.load, overlap, host_overlap, block_size, self._host_weight) if host_overlap else 0.0
        hit = overlap_ratio(overlap + credit * host_overlap, block_size, len(tokens))
        self._metrics.routed.labels(chosen.info.instance_id, pool.view.component).inc()
        self._metrics.record(len(tokens), min(len(tokens), (overlap + host_overlap) * block_size))
        self._metrics.decision_seconds.observe(time.perf_counter() - started)
        reply = router_pb2.RouteResponse(worker_id=chosen.info.instance_id, address=chosen.info.address,
                                         overlap_blocks=overlap, prefix_hit_rate=hit, pool_waiting=pool_waiting,
                                         host_overlap_blocks=host_overlap)
        if explanation is not None:
            log.debug("request %s (%s): %s", request.request_id, pool.view.component, explanation.log_line())
            if span.is_recording():
                span.set_attributes({"kvmesh.request_id": request.request_id, "kvmesh.route.pool": pool.view.component,
                                     "kvmesh.route.prefix_hit_rate": hit, **explanation.span_attributes()})
            if request.explain:
                reply.explanation.CopyFrom(explanation.to_proto())
        return reply

    async def FindMatches(  # noqa: N802
        self, request: router_pb2.FindMatchesRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.FindMatchesResponse:
        try:
            pool = self._pool(request.role)
        except CallError as exc:
            await abort_with(context, exc)
        serving = {w.info.instance_id for w in pool.candidates(request.model)}
        block_size = pool.block_size(request.model)
        if block_size is None:
            return router_pb2.FindMatchesResponse()
        scores, host = pool.index.find_matches_by_tier(local_block_hashes(request.token_ids, block_size))
        return router_pb2.FindMatchesResponse(
            scores={w: n for w, n in scores.items() if w in serving}, block_size=block_size,
            host_scores={w: n for w, n in host.items() if w in serving})
