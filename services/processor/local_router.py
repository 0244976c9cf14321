"""Routing inside the processor (`--routing local`): no router hop per request at all.

The processor keeps its own replica of the decode pool's index: the same `WorkerPool` (fed by
every decode worker's KV event and load streams) and the same `RouterServicer` decision the
kv-router service runs, called in-process. What it saves per request: one round trip (the
latency of a 1-token request at low load) and the router's and the session's work. What it
costs: every processor subscribes to every decode worker's streams and holds the index, and the
work in flight it counts between load reports is only what *this* processor dispatched (with
several processors each sees its own share; the workers' load reports, at least once a second,
carry everyone's). `--routing service` (the default) asks the kv-router service over sessions,
where one router sees what every processor dispatched.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from gen.kvmesh.v1 import common_pb2, router_pb2
from services.routing.servicer import RouterServicer
from services.mesh.router_client import NoWorkerError, RouteChoice, RoutingUnavailable
from services.mesh.session_kind import CallError
from services.mesh.tracing import TRACING_OFF, Tracing


class LocalRouter:
    """`RouterClient.route` for the decode pool, answered by this process's own index."""

    def __init__(self, servicer: RouterServicer, tracing: Tracing = TRACING_OFF) -> None:
        self._servicer = servicer
        self._tracing = tracing

    async def route(self, request_id: str, model: str, token_ids: Sequence[int], role: common_pb2.WorkerRole,
                    exclude: Sequence[str] = (), explain: bool = False) -> RouteChoice:
        request = router_pb2.RouteRequest(request_id=request_id, model=model, token_ids=token_ids, role=role,
                                          exclude_worker_ids=exclude, explain=explain)
        try:
            with self._tracing.span("route") as span:
                reply = self._servicer.decide(request, span)
        except CallError as exc:
            if exc.code == grpc.StatusCode.NOT_FOUND:
                raise NoWorkerError(exc.message) from exc
            raise RoutingUnavailable(f"local routing failed: {exc.code.name} {exc.message}") from exc
        return RouteChoice.of(reply)
