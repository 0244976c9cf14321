"""The kv-router process's gRPC service: the wire around one `Router` (router.py), which decides.

It converts each request to the router's plain values and each answer back (wire.py), and says
the router's refusals as the wire does: `NoWorker` is NO_WORKER, which a caller never asks another
router about (it would answer the same), and an unknown role BAD_REQUEST.

`Route` (a unary call) and a call on a `Session` are served by the same `route`. A session's call
that sets `hold` goes through admission: it may get a `queued` reply first, then its worker, and
then stays open, holding its place on the worker, until the caller ends it or this router drains.
Any call may carry feedback on earlier routings (RouteFeedback: what the engine found cached),
taken before its own decision; a call with feedback and no model carries nothing else and ends
with no reply.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import grpc

from gen.kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.contract.worker_roles import RoleName
from services.mesh.grpc_server import abort_with, as_unary_rpc
from services.mesh.logs import REQUEST_ID
from services.mesh.session_kind import ROUTER_SESSION, CallError, CallInfo, bad_request, call_info
from services.mesh.session_server import SessionHub
from services.mesh.tracing import TRACING_OFF, Tracing
from services.routing.admission.gate import Queued
from services.routing.route_query import NoWorker, UnknownPool
from services.routing.router import Router
from services.routing.wire import matches_response, query_of, response_of, role_of

ROUTE_RPC = "kvmesh.v1.Router/Route"


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, router: Router, tracing: Tracing = TRACING_OFF) -> None:
        self._router = router
        self._tracing = tracing
        # Callers' sessions: every routing they ask for, served by `route`.
        self.sessions = SessionHub(ROUTER_SESSION, self.route)
        self.sessions.on_drain(router.drain)

    async def Route(self, request: router_pb2.RouteRequest, context: grpc.aio.ServicerContext) -> router_pb2.RouteResponse:  # noqa: N802
        if request.hold:
            # A unary call ends with its reply: it can hold no place (admission needs a session).
            await abort_with(context, bad_request("hold needs a call on Router.Session, not Route"))
        if request.feedback and not request.model:
            # A unary call answers with one reply: feedback alone has none.
            await abort_with(context, bad_request("feedback without a request needs a call on Router.Session"))
        return await as_unary_rpc(context, self.route(request, call_info(context)))

    async def Session(self, frames: AsyncIterator[router_pb2.RouterSessionDown],  # noqa: N802
                      context: grpc.aio.ServicerContext) -> None:
        await self.sessions.serve(frames, context)

    async def route(self, request: router_pb2.RouteRequest, call: CallInfo) -> AsyncIterator[router_pb2.RouteResponse]:
        """One routing decision, for `Route` and for a call on a session alike. A call that
        `holds` is admitted first (it may wait, or be refused), and stays open after its reply
        until the caller ends it: its place on the worker is given back then."""
        if request.feedback:
            for feedback in request.feedback:
                self._router.report(feedback.request_id, feedback.worker_id, feedback.cached_tokens,
                                    feedback.prompt_tokens)
            if not request.model:
                return  # feedback only: the call ends with no reply
        REQUEST_ID.set(request.request_id)  # this call's task: its log lines carry the id
        with self._tracing.server_span("route", call, ROUTE_RPC) as span, _said_on_the_wire(request.role):
            query = query_of(request, _role(request.role))
            if not (request.hold and self._router.admits(query.role)):
                yield response_of(self._router.decide(query, span))
                return
            started = self._router.enter(query)
            if isinstance(started, Queued):
                try:
                    yield router_pb2.RouteResponse(queued=True)
                except BaseException:
                    self._router.abandon(started)  # closed here: it never began to wait
                    raise
                started = await self._router.wait(started)
            reply = response_of(self._router.place(query, started, span))
        try:
            yield reply
            # Until the caller ends the call, or this router drains: its places go with it, and
            # a router that is going away has no reason to keep a request's stream waiting.
            await self.sessions.drained.wait()
        finally:
            started.release()

    async def FindMatches(  # noqa: N802
        self, request: router_pb2.FindMatchesRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.FindMatchesResponse:
        try:
            with _said_on_the_wire(request.role):
                matches = self._router.find_matches(_role(request.role), request.model, request.token_ids,
                                                    request.lora_name)
        except CallError as exc:
            await abort_with(context, exc)
        return matches_response(matches)


def _role(role: common_pb2.WorkerRole) -> RoleName:
    name = role_of(role)
    if name is None:
        raise _unknown_role(role)
    return name


def _unknown_role(role: int) -> CallError:
    return bad_request(f"unknown worker role {role}")


@contextmanager
def _said_on_the_wire(role: int) -> Iterator[None]:
    """The router's refusals as the wire says them (`role`: the request's, as it came)."""
    try:
        yield
    except NoWorker as exc:
        raise CallError(common_pb2.OUTCOME_NO_WORKER, str(exc)) from None
    except UnknownPool:
        raise _unknown_role(role) from None
