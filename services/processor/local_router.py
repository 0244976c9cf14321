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
from services.mesh.router_client import Admit, Held, NoWorkerError, Overloaded, RouteChoice, RoutingUnavailable
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
            raise _routing_error(exc) from exc
        return RouteChoice.of(reply)

    async def admit(self, request_id: str, model: str, token_ids: Sequence[int], admit: Admit,
                    explain: bool = False, exclude: Sequence[str] = ()) -> tuple[RouteChoice, Held]:
        request = router_pb2.RouteRequest(request_id=request_id, model=model, token_ids=token_ids,
                                          role=common_pb2.WORKER_ROLE_DECODE, explain=explain, hold=True,
                                          exclude_worker_ids=exclude,
                                          qos=admit.qos, streams=admit.streams, max_tokens=admit.max_tokens,
                                          queue_timeout_ms=max(1, int(admit.queue_timeout_s * 1000)))
        try:
            reply, ticket = await self._servicer.admit(request)
        except CallError as exc:
            raise _routing_error(exc) from exc
        return RouteChoice.of(reply), ticket


def _routing_error(exc: CallError) -> Exception:
    if exc.code == grpc.StatusCode.NOT_FOUND:
        return NoWorkerError(exc.message)
    if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED and exc.final:
        return Overloaded(exc)
    return RoutingUnavailable(f"local routing failed: {exc.code.name} {exc.message}")
