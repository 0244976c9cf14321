"""The router's wire (router.proto) to and from the routing library's plain values (route_query.py):
the only place they are converted, by the servicer and by a processor routing in-process."""

from __future__ import annotations

from collections.abc import Sequence

from gen.kvmesh.v1 import common_pb2, router_pb2
from services.kv_protocol.media import MediaSpan
from services.contract.worker_roles import RoleName, role_name
from services.routing.route_query import Matches, Qos, Route, RouteQuery
from services.routing.session_bindings import SessionKey


def role_of(role: common_pb2.WorkerRole) -> RoleName | None:
    """The pool a wire role names: unspecified is the decode pool; None for an unknown role."""
    return role_name(role or common_pb2.WORKER_ROLE_DECODE)


def qos_of(qos: common_pb2.Qos) -> Qos:
    return Qos(priority=qos.priority, tenant=qos.tenant, ttft_objective_ms=qos.ttft_objective_ms,
               outside_queue_ms=qos.outside_queue_ms)


def query_of(request: router_pb2.RouteRequest, role: RoleName) -> RouteQuery:
    """The request as the router reads it (`role`: its pool, from `role_of`)."""
    return RouteQuery(request.request_id, request.model, request.token_ids, role,
                      frozenset(request.exclude_worker_ids), request.explain, qos_of(request.qos),
                      request.streams, request.max_tokens,
                      request.queue_timeout_ms / 1000 if request.queue_timeout_ms else None, request.lora_name,
                      session_of(request.session), media_of(request.media),
                      frozenset(request.avoid_worker_ids))


def media_of(media: Sequence[common_pb2.MediaSpan]) -> tuple[MediaSpan, ...]:
    """Where a prompt's images stand, as the block hashing reads it."""
    return tuple(MediaSpan(span.digest, span.offset, span.length) for span in media)


def session_of(session: common_pb2.SessionRef | None) -> SessionKey | None:
    """The session a wire request names (None: none, or no SessionRef at all)."""
    return SessionKey(session.id, session.parent_id) if session is not None and session.id else None


def response_of(route: Route) -> router_pb2.RouteResponse:
    reply = router_pb2.RouteResponse(worker_id=route.worker_id, address=route.address,
                                     overlap_blocks=route.overlap_blocks, prefix_hit_rate=route.prefix_hit_rate,
                                     pool_waiting=route.pool_waiting, host_overlap_blocks=route.host_overlap_blocks,
                                     queue_wait_ms=route.queue_wait_ms, session_retain_ms=route.session_retain_ms)
    if route.explanation is not None:
        reply.explanation.CopyFrom(route.explanation.to_proto())
    return reply


def matches_response(matches: Matches) -> router_pb2.FindMatchesResponse:
    return router_pb2.FindMatchesResponse(scores=matches.device, block_size=matches.block_size,
                                          host_scores=matches.host)
