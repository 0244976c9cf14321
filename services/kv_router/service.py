"""The router's gRPC service: picks a worker for each tokenized prompt."""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

from gen.kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.kv_router.policies import LeastLoaded, RandomChoice, RoundRobin
from services.kv_router.worker_pool import WorkerPool

log = logging.getLogger(__name__)

ROUTER_MODES = ("kv", "round-robin", "random")


@dataclass(frozen=True)
class RouterConfig:
    mode: str = "kv"
    seed: int | None = None


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decision_seconds = Histogram(
            "kvmesh_router_decision_latency_seconds", "time to pick a worker", registry=registry,
            buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05),
        )
        self.routed = Counter(
            "kvmesh_router_routed_requests_total", "requests routed, per worker", ["worker_id", "role"], registry=registry
        )
        self.no_worker = Counter("kvmesh_router_no_worker_total", "route requests with no eligible worker", registry=registry)


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, pools: dict[int, WorkerPool], config: RouterConfig, metrics: RouterMetrics) -> None:
        self._pools = pools
        self._config = config
        self._metrics = metrics
        rng = random.Random(config.seed)
        self._round_robin = RoundRobin()
        self._random = RandomChoice(rng)
        # Until the KV index lands, `kv` mode routes by load alone.
        self._least_loaded = LeastLoaded(rng)

    async def Route(self, request: router_pb2.RouteRequest, context: grpc.aio.ServicerContext) -> router_pb2.RouteResponse:
        started = time.perf_counter()
        role = request.role or common_pb2.WORKER_ROLE_DECODE
        pool = self._pools.get(role)
        if pool is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown worker role {role}")
        excluded = set(request.exclude_worker_ids)
        candidates = [w for w in pool.candidates(request.model) if w.info.instance_id not in excluded]
        if not candidates:
            self._metrics.no_worker.inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"no {pool.view.component} serves model {request.model!r}")
        if self._config.mode == "round-robin":
            chosen = self._round_robin.pick(candidates)
        elif self._config.mode == "random":
            chosen = self._random.pick(candidates)
        else:
            chosen = self._least_loaded.pick(candidates)
        chosen.dispatched_since_load += 1
        self._metrics.routed.labels(chosen.info.instance_id, pool.view.component).inc()
        self._metrics.decision_seconds.observe(time.perf_counter() - started)
        log.debug("request %s -> %s", request.request_id, chosen.info.instance_id)
        return router_pb2.RouteResponse(worker_id=chosen.info.instance_id, address=chosen.info.address)

    async def FindMatches(  # noqa: N802
        self, request: router_pb2.FindMatchesRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.FindMatchesResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the KV index is not built yet")
