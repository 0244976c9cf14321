"""Routing inside the processor (`--routing local`): no router hop per request at all.

The processor keeps its own replica of the decode pool's index: the same `WorkerPool` (fed by
every decode worker's KV event and load streams) and the same `Router` the kv-router service
serves, called in-process on plain values (no protobuf is built or parsed to route). What it
saves per request: one round trip (the latency of a 1-token request at low load) and the
router's and the session's work. What it costs: every processor subscribes to every decode
worker's streams and holds the index, and the work in flight it counts between load reports is
only what *this* processor dispatched (with several processors each sees its own share; the
workers' load reports, at least once a second, carry everyone's). `--routing service` (the
default) asks the kv-router service over sessions, where one router sees what every processor
dispatched.
"""

from __future__ import annotations

from collections.abc import Sequence

from gen.kvmesh.v1 import common_pb2
from services.mesh.session_kind import CallError
from services.mesh.tracing import TRACING_OFF, Tracing
from services.routing.route_query import NoWorker, Route, RouteQuery, UnknownPool
from services.routing.router import Router
from services.routing.router_client import Admit, Held, NoWorkerError, RouteChoice, RoutingUnavailable, routing_error
from services.routing.wire import media_of, qos_of, role_of, session_of


class LocalRouter:
    """`RouterClient.route` for the decode pool, answered by this process's own `Router`."""

    def __init__(self, router: Router, tracing: Tracing = TRACING_OFF) -> None:
        self._router = router
        self._tracing = tracing

    async def route(self, request_id: str, model: str, token_ids: Sequence[int], role: common_pb2.WorkerRole,
                    exclude: Sequence[str] = (), explain: bool = False, lora_name: str = "",
                    session: common_pb2.SessionRef | None = None,
                    media: Sequence[common_pb2.MediaSpan] = (), avoid: Sequence[str] = ()) -> RouteChoice:
        name = role_of(role)
        if name is None:
            raise _unknown_role(role)
        query = RouteQuery(request_id, model, token_ids, name, frozenset(exclude), explain, lora_name=lora_name,
                           session=session_of(session), media=media_of(media), avoid=frozenset(avoid))
        try:
            with self._tracing.span("route") as span:
                return _choice(self._router.decide(query, span), request_id)
        except NoWorker as exc:
            raise NoWorkerError(str(exc)) from exc
        except UnknownPool as exc:
            raise _unknown_role(role) from exc

    async def admit(self, request_id: str, model: str, token_ids: Sequence[int], admit: Admit,
                    explain: bool = False, exclude: Sequence[str] = (), lora_name: str = "",
                    session: common_pb2.SessionRef | None = None,
                    media: Sequence[common_pb2.MediaSpan] = (), avoid: Sequence[str] = ()) -> tuple[RouteChoice, Held]:
        query = RouteQuery(request_id, model, token_ids, exclude=frozenset(exclude), explain=explain,
                           qos=qos_of(admit.qos), streams=admit.streams, max_tokens=admit.max_tokens,
                           queue_timeout_s=admit.queue_timeout_s, lora_name=lora_name,
                           session=session_of(session), media=media_of(media), avoid=frozenset(avoid))
        try:
            with self._tracing.span("route") as span:
                route, ticket = await self._router.admit(query, span)
        except NoWorker as exc:
            raise NoWorkerError(str(exc)) from exc
        except CallError as exc:
            raise routing_error(exc, "local routing") from exc  # admission's refusal, as the routers' client raises it
        return _choice(route, request_id), ticket

    def report(self, choice: RouteChoice, prompt_tokens: int, cached_tokens: int) -> None:
        """What the engine found cached, straight to this process's router (its index accuracy)."""
        self._router.report(choice.request_id, choice.worker_id, cached_tokens, prompt_tokens)


def _choice(route: Route, request_id: str) -> RouteChoice:
    explanation = route.explanation.to_proto() if route.explanation is not None else None
    return RouteChoice(worker_id=route.worker_id, address=route.address, overlap_blocks=route.overlap_blocks,
                       prefix_hit_rate=route.prefix_hit_rate, pool_waiting=route.pool_waiting,
                       explanation=explanation, queue_wait_ms=route.queue_wait_ms,
                       session_retain_ms=route.session_retain_ms, request_id=request_id)


def _unknown_role(role: int) -> RoutingUnavailable:
    return RoutingUnavailable(f"local routing failed: this processor follows the decode pool only, not role {role}")
