"""A per-request RPC served by session code (services/mesh/grpc_server.py `as_rpc`, `abort_with`)
ends with its outcome's gRPC status and says the outcome itself, the field at fault and when to
retry in its trailers, for plain gRPC clients (grpcurl) that know nothing of sessions."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from gen.kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.mesh.grpc_server import STATUS_OF, as_unary_rpc
from services.mesh.session_kind import CallError
from tests.unit.in_process_grpc import serving


class Refusing(router_pb2_grpc.RouterServicer):
    """`Route` ends with the outcome named by the request's model."""

    async def Route(self, request: router_pb2.RouteRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> router_pb2.RouteResponse:
        return await as_unary_rpc(context, self.route(request, context))

    async def route(self, request: router_pb2.RouteRequest,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[router_pb2.RouteResponse]:
        outcome = common_pb2.Outcome.Value(request.model)
        if outcome == common_pb2.OUTCOME_OK:
            yield router_pb2.RouteResponse(worker_id="w")
            return
        raise CallError(outcome, f"scripted {request.model}", param="messages", retry_after_ms=1500)


async def call(outcome: str) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    async with serving(router_pb2_grpc.add_RouterServicer_to_server, Refusing()) as address:
        async with grpc.aio.insecure_channel(address) as channel:
            try:
                await router_pb2_grpc.RouterStub(channel).Route(router_pb2.RouteRequest(model=outcome), timeout=10)
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details() or "", {k: v for k, v in (exc.trailing_metadata() or ())}
    return grpc.StatusCode.OK, "", {}


FAILURES = [name for name in common_pb2.Outcome.keys() if name != "OUTCOME_OK"]


def test_every_failure_outcome_has_a_status_and_none_is_ok() -> None:
    assert sorted(common_pb2.Outcome.Name(o) for o in STATUS_OF) == sorted(FAILURES)
    assert grpc.StatusCode.OK not in STATUS_OF.values()


@pytest.mark.parametrize("outcome", FAILURES)
async def test_an_rpc_ends_with_its_outcomes_status_and_names_the_outcome(outcome: str) -> None:
    code, details, trailers = await call(outcome)
    assert code == STATUS_OF[common_pb2.Outcome.Value(outcome)]
    assert details == f"scripted {outcome}"
    assert (trailers["kvmesh-outcome"], trailers["kvmesh-param"], trailers["retry-after-ms"]) == (
        outcome, "messages", "1500")


async def test_an_rpc_that_ends_well_is_answered() -> None:
    assert (await call("OUTCOME_OK"))[0] == grpc.StatusCode.OK
