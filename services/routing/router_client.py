"""Asking the mesh's routers for a worker: the one client the processor and decode workers share.

Rules (which outcome moves the call to another router is the outcome table's,
services/contract/outcomes.py, hop ROUTER):
- Any live router will do: calls rotate over the routers registered in etcd, so load spreads
  and a dead one costs one retry, not an outage.
- A router gone, draining, failing or past the call's deadline could not answer: the same call
  goes to the next router (each router at most once per call), and for `avoid_s` that router is
  asked after every other one. A router cut off from this caller alone (a partition, not a
  death: it stays registered) then costs one call a deadline per `avoid_s`, not every call
  whose turn it is.
- NO_WORKER means the router answered: no worker of the pool serves the model, or the LoRA
  adapter of it the call names (after the caller's exclusions). It is raised as `NoWorkerError`
  and never asked elsewhere: every router sees the same etcd membership.
- OVERLOADED is admission's refusal: raised as `Overloaded`, with when to retry, and not asked
  elsewhere, except a refusal for a tenant's limits, of which each router holds a share: the
  other routers are asked first.
- Any other outcome, or no router at all, is `RoutingUnavailable`.

`admit` asks for a new request's worker through the router's admission (its queue): the call
holds the request's place on the worker after the reply, until the caller releases it.

`report` tells the router that chose a worker what the engine found cached of the prompt (its
index accuracy, services/routing/index_accuracy.py). The feedback rides on the next call to that
router; with none within `FEEDBACK_WAIT_S` it goes alone, in a call of its own on the session.
It is best effort: feedback for a router that fails or leaves meanwhile is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import Protocol, TypeVar

from gen.kvmesh.v1 import common_pb2, router_pb2
from services.mesh.turns import in_turn
from services.contract.outcomes import Action, Hop, verdict
from services.mesh.discovery import InstanceInfo
from services.mesh.recent_failures import HOLD_S, RecentFailures
from services.mesh.session_client import Session, SessionPool, SessionStream
from services.mesh.session_kind import ROUTER_SESSION, CallError
from services.mesh.tracing import outgoing_metadata

log = logging.getLogger(__name__)

ROUTE_TIMEOUT_S = 2.0
# How long feedback waits for a call to the same router to ride on before it goes alone: under
# load it always finds one; at rest it costs one small call per router per interval.
FEEDBACK_WAIT_S = 0.1
# Feedback held for one router at most (the oldest dropped): a router that takes none meanwhile.
MAX_FEEDBACK_PER_ROUTER = 4096
H = TypeVar("H")


class RoutingError(Exception):
    """No worker could be chosen."""


class NoWorkerError(RoutingError):
    """No worker of the requested pool serves the model (the router's OUTCOME_NO_WORKER)."""


class RoutingUnavailable(RoutingError):
    """No router could answer: none registered, or every one failed."""


class Overloaded(RoutingError):
    """Admission refused the request (the router's OUTCOME_OVERLOADED): `error` says why and
    when a retry may fit; the caller answers with it as it is."""

    def __init__(self, error: CallError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass(frozen=True, slots=True)
class Admit:
    """What admission weighs of a request beyond its prompt."""

    qos: common_pb2.Qos
    # Its choices: its weight on the worker.
    streams: int = 1
    max_tokens: int = 0
    # How long it may wait for a worker at most.
    queue_timeout_s: float = 30.0


class Held(Protocol):
    """An admitted request's place on its worker, given back once at the request's end."""

    def release(self) -> None: ...


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
    # How long admission kept the request waiting for a worker with room.
    queue_wait_ms: int = 0
    # A session's request: how long the worker should keep the session's blocks (0: not at all).
    session_retain_ms: int = 0
    # Who decided, for `Routes.report`: the request id it was asked with and the router's
    # address ("" for a processor routing in-process).
    request_id: str = field(default="", compare=False)
    router: str = field(default="", compare=False)

    @classmethod
    def of(cls, reply: router_pb2.RouteResponse, request_id: str = "", router: str = "") -> RouteChoice:
        return cls(reply.worker_id, reply.address, reply.overlap_blocks, reply.prefix_hit_rate, reply.pool_waiting,
                   reply.explanation if reply.HasField("explanation") else None, reply.queue_wait_ms,
                   reply.session_retain_ms, request_id, router)


class Members(Protocol):
    """The live instances of one component (a `ComponentView`)."""

    @property
    def instances(self) -> Mapping[str, InstanceInfo]: ...


class Routes(Protocol):
    """What routes a request: the routers over sessions (RouterClient), or an in-process index."""

    async def route(self, request_id: str, model: str, token_ids: Sequence[int], role: common_pb2.WorkerRole,
                    exclude: Sequence[str] = (), explain: bool = False, lora_name: str = "",
                    session: common_pb2.SessionRef | None = None,
                    media: Sequence[common_pb2.MediaSpan] = (), avoid: Sequence[str] = ()) -> RouteChoice:
        """A worker of the `role` pool for the prompt, run with LoRA adapter `lora_name` of
        `model` ("" for the base model): only workers knowing the adapter are candidates; of the
        agent `session` (None: none), whose binding the router weighs and renews; `media` where
        the prompt's images stand (their blocks hash with them). `exclude`: workers it must not
        take (those the request tried); `avoid`: workers seen failing lately, taken only when no
        other serves the request."""
        ...

    async def admit(self, request_id: str, model: str, token_ids: Sequence[int], admit: Admit,
                    explain: bool = False, exclude: Sequence[str] = (), lora_name: str = "",
                    session: common_pb2.SessionRef | None = None,
                    media: Sequence[common_pb2.MediaSpan] = (), avoid: Sequence[str] = ()) -> tuple[RouteChoice, Held]:
        """A decode worker for a new request, through admission: it may wait, or be refused
        (`Overloaded`); the place it holds is released by the caller at the request's end."""
        ...

    def report(self, choice: RouteChoice, prompt_tokens: int, cached_tokens: int) -> None:
        """What the engine found cached of the `prompt_tokens` routed by `choice` (its first
        output's cached_tokens), for whoever decided: once per routing, never waited on."""
        ...


class _HeldCall:
    """A held route call: ending it gives the request's place back."""

    __slots__ = ("_stream",)

    def __init__(self, stream: SessionStream) -> None:
        self._stream = stream

    def release(self) -> None:
        self._stream.cancel()


class RouterClient:
    """Routes over one session per router (session_client.py): no round trip of its own per request."""

    def __init__(self, routers: Members, sessions: SessionPool, timeout_s: float = ROUTE_TIMEOUT_S,
                 avoid_s: float = HOLD_S, clock: Callable[[], float] = time.monotonic) -> None:
        """`clock` times how long a router that failed is asked last (a test passes its own)."""
        self._routers = routers
        self._sessions = sessions
        self._timeout_s = timeout_s
        self._turn = count()
        self._failed = RecentFailures(avoid_s, clock=clock)
        # Per router address, feedback not sent yet, and the timer that sends it alone.
        self._feedback: dict[str, deque[router_pb2.RouteFeedback]] = {}
        self._flushing: dict[str, asyncio.TimerHandle] = {}
        self._closed = False

    async def close(self) -> None:
        """The process is going away: feedback not sent yet is dropped with its timers (a timer
        that fired later would open a session on a pool being torn down)."""
        self._closed = True
        for timer in self._flushing.values():
            timer.cancel()
        self._flushing.clear()
        self._feedback.clear()

    def report(self, choice: RouteChoice, prompt_tokens: int, cached_tokens: int) -> None:
        if not choice.router or self._closed:
            return
        pending = self._feedback.get(choice.router)
        if pending is None:
            pending = self._feedback[choice.router] = deque(maxlen=MAX_FEEDBACK_PER_ROUTER)
        pending.append(router_pb2.RouteFeedback(request_id=choice.request_id, worker_id=choice.worker_id,
                                                cached_tokens=cached_tokens, prompt_tokens=prompt_tokens))
        if choice.router not in self._flushing:
            self._flushing[choice.router] = asyncio.get_running_loop().call_later(
                FEEDBACK_WAIT_S, self._flush, choice.router)

    def _attach(self, request: router_pb2.RouteRequest, router: str) -> None:
        """The router's pending feedback onto a call about to go to it (none for another router
        it was put on before: a call moves on from a router that could not answer)."""
        request.ClearField("feedback")
        pending = self._feedback.pop(router, None)
        if pending:
            request.feedback.extend(pending)

    def _flush(self, router: str) -> None:
        """Feedback that found no call to ride on goes alone (while the router is still registered)."""
        del self._flushing[router]
        pending = self._feedback.pop(router, None)
        if pending and any(r.address == router for r in self._routers.instances.values()):
            # Not waited on: it ends with no reply, or fails, and either way nothing is retried.
            self._sessions.get(ROUTER_SESSION, router).open(router_pb2.RouteRequest(feedback=pending), self._timeout_s)

    async def route(self, request_id: str, model: str, token_ids: Sequence[int], role: common_pb2.WorkerRole,
                    exclude: Sequence[str] = (), explain: bool = False, lora_name: str = "",
                    session: common_pb2.SessionRef | None = None,
                    media: Sequence[common_pb2.MediaSpan] = (), avoid: Sequence[str] = ()) -> RouteChoice:
        request = router_pb2.RouteRequest(request_id=request_id, model=model, token_ids=token_ids, role=role,
                                          exclude_worker_ids=exclude, explain=explain, lora_name=lora_name,
                                          session=session, media=media, avoid_worker_ids=avoid)
        # The router's span joins the caller's trace (None when the caller traces nothing).
        metadata = outgoing_metadata()

        async def ask(session: Session) -> tuple[router_pb2.RouteResponse, None]:
            self._attach(request, session.address)
            return await session.call(request, self._timeout_s, metadata), None

        return (await self._ask(request_id, ask))[0]

    async def admit(self, request_id: str, model: str, token_ids: Sequence[int], admit: Admit,
                    explain: bool = False, exclude: Sequence[str] = (), lora_name: str = "",
                    session: common_pb2.SessionRef | None = None,
                    media: Sequence[common_pb2.MediaSpan] = (), avoid: Sequence[str] = ()) -> tuple[RouteChoice, Held]:
        queue_ms = max(1, int(admit.queue_timeout_s * 1000))
        request = router_pb2.RouteRequest(request_id=request_id, model=model, token_ids=token_ids,
                                          role=common_pb2.WORKER_ROLE_DECODE, explain=explain, hold=True,
                                          exclude_worker_ids=exclude, lora_name=lora_name, session=session,
                                          qos=admit.qos, streams=admit.streams, max_tokens=admit.max_tokens,
                                          queue_timeout_ms=queue_ms, media=media, avoid_worker_ids=avoid)
        metadata = outgoing_metadata()
        # The router answers at once (a worker, a refusal, or "queued"), and a queued request
        # within the queue's bound; a router that does not is taken for one that cannot answer.
        deadline_s = admit.queue_timeout_s + self._timeout_s

        async def ask(session: Session) -> tuple[router_pb2.RouteResponse, Held]:
            # No deadline on the call itself: once answered it stays open until the request ends.
            self._attach(request, session.address)
            stream = session.open(request, None, metadata)
            try:
                async with asyncio.timeout(self._timeout_s):
                    reply = await stream.result()
                if reply.queued:
                    async with asyncio.timeout(deadline_s):
                        reply = await stream.result()
            except TimeoutError:
                stream.cancel()
                raise CallError(common_pb2.OUTCOME_DEADLINE, "no answer from the router in time") from None
            except BaseException:
                stream.cancel()
                raise
            return reply, _HeldCall(stream)

        reply, held = await self._ask(request_id, ask)
        assert held is not None
        return reply, held

    async def _ask(self, request_id: str, ask: Callable[[Session], Awaitable[tuple[router_pb2.RouteResponse, H]]]
                   ) -> tuple[RouteChoice, H]:
        """Asks the routers in turn until one answers (see the module's rules)."""
        routers = in_turn(self._routers.instances.values(), next(self._turn), lambda r: r.instance_id)
        if not routers:
            raise RoutingUnavailable("no router is available")
        failed = set(self._failed.current())
        # This call's turn first, then the rest in order; those that failed lately after all others.
        order = sorted(routers, key=lambda r: r.instance_id in failed)
        failures = []
        limited: CallError | None = None
        for router in order:
            try:
                reply, held = await ask(self._sessions.get(ROUTER_SESSION, router.address))
            except CallError as exc:
                judged = verdict(Hop.ROUTER, exc.outcome, overload=exc.overload)
                if judged.action is Action.ANSWER:
                    raise routing_error(exc, f"router {router.instance_id}") from exc
                if exc.outcome == common_pb2.OUTCOME_OVERLOADED:
                    limited = exc  # this router's share of the tenant's limit: another may have room
                    continue
                failures.append(f"router {router.instance_id}: {exc.outcome_name} {exc.message}")
                if judged.set_aside:
                    self._failed.add(router.instance_id)
                log.debug("request %s: router %s could not answer (%s); trying the next", request_id,
                          router.instance_id, exc.outcome_name)
                continue
            if router.instance_id in failed:
                self._failed.discard(router.instance_id)  # it answered: back in its turn
            return RouteChoice.of(reply, request_id, router.address), held
        if limited is not None:
            raise Overloaded(limited)
        raise RoutingUnavailable("routing failed: " + "; ".join(failures))


def routing_error(exc: CallError, source: str) -> RoutingError:
    """A router's answer (not one to ask another router about) as the error routing raises;
    `source` names who answered, for the message."""
    if exc.outcome == common_pb2.OUTCOME_NO_WORKER:
        return NoWorkerError(exc.message)
    if exc.outcome == common_pb2.OUTCOME_OVERLOADED:
        return Overloaded(exc)
    return RoutingUnavailable(f"routing failed: {source}: {exc.outcome_name} {exc.message}")
