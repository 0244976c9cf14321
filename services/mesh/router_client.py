"""Asking the mesh's routers for a worker: the one client the processor and decode workers share.

Rules:
- Any live router will do: calls rotate over the routers registered in etcd, so load spreads
  and a dead one costs one retry, not an outage.
- `UNAVAILABLE` or `DEADLINE_EXCEEDED` from a router means *that router* could not answer:
  the same call goes to the next router (each router at most once per call), and for
  `avoid_s` that router is asked after every other one. A router cut off from this caller alone
  (a partition, not a death: it stays registered) then costs one call a deadline per `avoid_s`,
  not every call whose turn it is.
- `NOT_FOUND` means the router answered: no worker of the pool serves the model (after the
  caller's exclusions). That outcome is raised as `NoWorkerError` and never retried elsewhere:
  every router sees the same etcd membership.
- Any other status, or no router at all, is `RoutingUnavailable`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import count
from typing import Protocol

import grpc

from gen.kvmesh.v1 import common_pb2, router_pb2
from services.mesh.discovery import InstanceInfo
from services.mesh.recent_failures import HOLD_S, RecentFailures
from services.mesh.session_client import SessionPool
from services.mesh.session_kind import ROUTER_SESSION, CallError
from services.mesh.tracing import outgoing_metadata

log = logging.getLogger(__name__)

ROUTE_TIMEOUT_S = 2.0
# Codes that say a router could not answer, so another one should be asked.
TRY_NEXT_ROUTER = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class RoutingError(Exception):
    """No worker could be chosen."""


class NoWorkerError(RoutingError):
    """No worker of the requested pool serves the model (the router's NOT_FOUND)."""


class RoutingUnavailable(RoutingError):
    """No router could answer: none registered, or every one failed."""


@dataclass(frozen=True, slots=True)
class RouteChoice:
    worker_id: str
    address: str
    overlap_blocks: int
    # Share of the prompt's tokens already cached on the chosen worker.
    prefix_hit_rate: float
    # Requests waiting across the whole pool (the prefill queue size, for the prefill pool).
    pool_waiting: int
    # Why this worker: set when the call asked to `explain`.
    explanation: common_pb2.RouteExplanation | None = None

    @classmethod
    def of(cls, reply: router_pb2.RouteResponse) -> RouteChoice:
        return cls(reply.worker_id, reply.address, reply.overlap_blocks, reply.prefix_hit_rate, reply.pool_waiting,
                   reply.explanation if reply.HasField("explanation") else None)


class Members(Protocol):
    """The live instances of one component (a `ComponentView`)."""

    @property
    def instances(self) -> Mapping[str, InstanceInfo]: ...


class Routes(Protocol):
    """What routes a request: the routers over sessions (RouterClient), or an in-process index."""

    async def route(self, request_id: str, model: str, token_ids: Sequence[int], role: common_pb2.WorkerRole,
                    exclude: Sequence[str] = (), explain: bool = False) -> RouteChoice: ...


class RouterClient:
    """Routes over one session per router (session_client.py): no round trip of its own per request."""

    def __init__(self, routers: Members, sessions: SessionPool, timeout_s: float = ROUTE_TIMEOUT_S,
                 avoid_s: float = HOLD_S) -> None:
        self._routers = routers
        self._sessions = sessions
        self._timeout_s = timeout_s
        self._turn = count()
        self._failed = RecentFailures(avoid_s)

    async def route(self, request_id: str, model: str, token_ids: Sequence[int], role: common_pb2.WorkerRole,
                    exclude: Sequence[str] = (), explain: bool = False) -> RouteChoice:
        routers = sorted(self._routers.instances.values(), key=lambda r: r.instance_id)
        if not routers:
            raise RoutingUnavailable("no router is available")
        request = router_pb2.RouteRequest(request_id=request_id, model=model, token_ids=token_ids, role=role,
                                          exclude_worker_ids=exclude, explain=explain)
        # The router's span joins the caller's trace (None when the caller traces nothing).
        metadata = outgoing_metadata()
        start = next(self._turn)
        failed = set(self._failed.current())
        # This call's turn first, then the rest in order; those that failed lately after all others.
        order = sorted(routers[start % len(routers):] + routers[:start % len(routers)],
                       key=lambda r: r.instance_id in failed)
        failures = []
        for router in order:
            try:
                reply = await self._sessions.get(ROUTER_SESSION, router.address).call(request, self._timeout_s, metadata)
            except CallError as exc:
                detail = exc.message or exc.code.name
                if exc.code == grpc.StatusCode.NOT_FOUND:
                    raise NoWorkerError(detail) from exc
                failures.append(f"router {router.instance_id}: {exc.code.name} {detail}")
                if exc.code not in TRY_NEXT_ROUTER:
                    break
                self._failed.add(router.instance_id)
                log.debug("request %s: router %s could not answer (%s); trying the next", request_id,
                          router.instance_id, exc.code.name)
                continue
            if router.instance_id in failed:
                self._failed.discard(router.instance_id)  # it answered: back in its turn
            return RouteChoice.of(reply)
        raise RoutingUnavailable("routing failed: " + "; ".join(failures))
