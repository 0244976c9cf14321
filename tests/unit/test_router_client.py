"""The router client's contract (services/routing/router_client.py), against real in-process gRPC routers.

Each router here is a real `grpc.aio` server on 127.0.0.1 serving sessions, whose routing follows
a script: answer, fail with a status, or never answer. The client gets a real `ChannelPool` and, in place of a
`ComponentView`, a stand-in holding the routers' `InstanceInfo`s in `.instances` (the only part
of the view it reads). No etcd, no child process: the whole file runs in a few seconds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc
import pytest

from gen.kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.mesh.channels import ChannelPool
from services.mesh.discovery import ROUTER, InstanceInfo
from services.mesh.net import free_port
from services.mesh.recent_failures import HOLD_S
from services.routing.router_client import Admit, NoWorkerError, RouteChoice, RouterClient, RoutingUnavailable
from services.mesh.session_client import SessionPool
from services.mesh.session_kind import ROUTER_SESSION, CallError, CallInfo
from services.mesh.session_server import SessionHub

MODEL = "kvmesh-demo"
TOKENS = [101, 102, 103, 104, 105]
DECODE, PREFILL = common_pb2.WORKER_ROLE_DECODE, common_pb2.WORKER_ROLE_PREFILL
# Long enough for an answering router on a loaded 2-core machine, short for one that never answers.
SHORT_TIMEOUT_S = 0.5

# What each scripted behaviour makes `Route` do.
OK = "ok"
ABORTS = {
    "unavailable": common_pb2.OUTCOME_PEER_GONE,
    "draining": common_pb2.OUTCOME_PEER_DRAINING,
    "deadline": common_pb2.OUTCOME_DEADLINE,
    "not_found": common_pb2.OUTCOME_NO_WORKER,
    "invalid_argument": common_pb2.OUTCOME_BAD_REQUEST,
    "internal": common_pb2.OUTCOME_PEER_FAILED,
}
HANGS = "hangs"  # never answers: the client's own deadline ends the call
DEAD = "dead"  # nothing listens at its address


@dataclass
class ScriptedRouter(router_pb2_grpc.RouterServicer):
    """Serves `Session` (what the client uses) through a real SessionHub, as the router does."""

    instance_id: str
    behaviour: str
    calls: list[router_pb2.RouteRequest] = field(default_factory=list)
    address: str = ""

    def __post_init__(self) -> None:
        self.sessions = SessionHub(ROUTER_SESSION, self.route)

    async def Session(self, frames: AsyncIterator[router_pb2.RouterSessionDown],  # noqa: N802
                      context: grpc.aio.ServicerContext) -> None:
        await self.sessions.serve(frames, context)

    async def route(self, request: router_pb2.RouteRequest, call: CallInfo) -> AsyncIterator[router_pb2.RouteResponse]:
        self.calls.append(request)
        if self.behaviour in ABORTS:
            raise CallError(ABORTS[self.behaviour], f"scripted {self.behaviour} from {self.instance_id}")
        if self.behaviour == HANGS:
            await asyncio.Event().wait()  # cancelled when the client gives up or the server stops
        assert self.behaviour == OK, self.behaviour
        yield router_pb2.RouteResponse(worker_id=f"worker-via-{self.instance_id}", address="10.0.0.7:5555",
                                       overlap_blocks=3, prefix_hit_rate=0.25, pool_waiting=4)


@dataclass
class Members:
    """Stand-in for a ComponentView: the router client only reads `.instances`."""

    instances: dict[str, InstanceInfo]


@dataclass
class Routers:
    client: RouterClient
    routers: list[ScriptedRouter]

    def __getitem__(self, instance_id: str) -> ScriptedRouter:
        return next(r for r in self.routers if r.instance_id == instance_id)

    def called(self) -> dict[str, int]:
        return {r.instance_id: len(r.calls) for r in self.routers}


@asynccontextmanager
async def routers(*behaviours: str, timeout_s: float = 2.0, avoid_s: float = HOLD_S,
                  clock: Callable[[], float] = time.monotonic) -> AsyncIterator[Routers]:
    """Routers r0, r1, ... (the client tries them in id order from its turn) with these behaviours."""
    scripted, servers = [], []
    pool = ChannelPool()
    sessions = SessionPool(pool)
    try:
        for i, behaviour in enumerate(behaviours):
            router = ScriptedRouter(f"r{i}", behaviour)
            if behaviour == DEAD:
                router.address = f"127.0.0.1:{free_port()}"
            else:
                server = grpc.aio.server()
                router_pb2_grpc.add_RouterServicer_to_server(router, server)
                router.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
                await server.start()
                servers.append(server)
            scripted.append(router)
        members = Members({r.instance_id: InstanceInfo(component=ROUTER, instance_id=r.instance_id, address=r.address)
                           for r in scripted})
        yield Routers(RouterClient(members, sessions, timeout_s=timeout_s, avoid_s=avoid_s, clock=clock), scripted)
    finally:
        await sessions.close()
        await pool.close()
        for server in servers:
            await server.stop(None)


async def route(client: RouterClient, rid: str = "req-1", exclude: tuple[str, ...] = ()) -> RouteChoice:
    return await client.route(rid, MODEL, TOKENS, DECODE, exclude)


async def test_a_router_answer_becomes_the_route_choice() -> None:
    async with routers(OK) as mesh:
        choice = await route(mesh.client)
    assert choice == RouteChoice(worker_id="worker-via-r0", address="10.0.0.7:5555", overlap_blocks=3,
                                 prefix_hit_rate=0.25, pool_waiting=4)


async def test_the_request_reaches_the_router_as_sent() -> None:
    async with routers(OK) as mesh:
        await mesh.client.route("req-fields", "other-model", [7, 8, 9, 65000], PREFILL, ("w-bad", "w-worse"))
        (request,) = mesh["r0"].calls
    assert request.request_id == "req-fields"
    assert request.model == "other-model"
    assert list(request.token_ids) == [7, 8, 9, 65000]
    assert request.role == PREFILL
    assert list(request.exclude_worker_ids) == ["w-bad", "w-worse"]


async def test_calls_rotate_over_the_routers() -> None:
    async with routers(OK, OK, OK) as mesh:
        answered_by = [(await route(mesh.client, f"req-{i}")).worker_id for i in range(6)]
        assert mesh.called() == {"r0": 2, "r1": 2, "r2": 2}
    assert answered_by == [f"worker-via-r{i % 3}" for i in range(6)]


@pytest.mark.parametrize("failure", ["unavailable", "draining", "internal", "deadline", HANGS, DEAD])
async def test_a_router_that_cannot_answer_costs_one_retry_on_the_next(failure: str) -> None:
    # The first call's turn starts at r0, so the failing router is asked first.
    async with routers(failure, OK, timeout_s=SHORT_TIMEOUT_S) as mesh:
        choice = await route(mesh.client)
        assert choice.worker_id == "worker-via-r1"
        assert mesh.called() == {"r0": 0 if failure == DEAD else 1, "r1": 1}


async def test_a_router_that_could_not_answer_is_asked_last_for_a_while() -> None:
    # A router cut off from this caller alone stays registered: without this, every call whose
    # turn it is would wait out its deadline first.
    async with routers(HANGS, OK, OK, timeout_s=SHORT_TIMEOUT_S) as mesh:
        answered_by = [(await route(mesh.client, f"req-{i}")).worker_id for i in range(4)]
        assert mesh.called()["r0"] == 1  # the fourth call's turn was r0's again
    assert answered_by == ["worker-via-r1", "worker-via-r1", "worker-via-r2", "worker-via-r1"]


@dataclass
class FakeClock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_router_avoided_for_a_while_is_asked_again_after_it() -> None:
    clock = FakeClock()
    async with routers("unavailable", OK, avoid_s=0.2, clock=clock) as mesh:
        await route(mesh.client, "req-0")  # r0 fails, r1 answers
        clock.now += 0.3
        await route(mesh.client, "req-1")  # r1's turn
        await route(mesh.client, "req-2")  # r0's turn, and its time out of turn is over
        assert mesh.called() == {"r0": 2, "r1": 3}


async def test_each_router_is_tried_at_most_once_per_call() -> None:
    async with routers("unavailable", "deadline", "unavailable") as mesh:
        with pytest.raises(RoutingUnavailable):
            await route(mesh.client)
        assert mesh.called() == {"r0": 1, "r1": 1, "r2": 1}
        # A second call starts at the next router and again asks each one once.
        with pytest.raises(RoutingUnavailable):
            await route(mesh.client)
        assert mesh.called() == {"r0": 2, "r1": 2, "r2": 2}


async def test_every_router_failing_is_routing_unavailable_naming_each_router() -> None:
    async with routers("unavailable", HANGS, DEAD, timeout_s=SHORT_TIMEOUT_S) as mesh:
        with pytest.raises(RoutingUnavailable) as failed:
            await route(mesh.client)
    message = str(failed.value)
    assert "router r0: PEER_GONE" in message
    assert "router r1: DEADLINE" in message
    assert "router r2: PEER_GONE" in message


async def test_not_found_is_no_worker_at_once_without_asking_another_router() -> None:
    async with routers("not_found", OK) as mesh:
        with pytest.raises(NoWorkerError, match="scripted not_found from r0"):
            await route(mesh.client)
        assert mesh.called() == {"r0": 1, "r1": 0}


def test_no_worker_is_not_routing_unavailable() -> None:
    # Callers tell "the pool is empty" from "no router answered" by type.
    assert not issubclass(NoWorkerError, RoutingUnavailable)
    assert not issubclass(RoutingUnavailable, NoWorkerError)


@pytest.mark.parametrize("failure, code", [("invalid_argument", "BAD_REQUEST")])
async def test_an_outcome_that_is_the_answer_stops_without_trying_other_routers(failure: str, code: str) -> None:
    async with routers(failure, OK) as mesh:
        with pytest.raises(RoutingUnavailable, match=f"router r0: {code}"):
            await route(mesh.client)
        assert mesh.called() == {"r0": 1, "r1": 0}


async def test_no_registered_router_is_routing_unavailable() -> None:
    async with routers() as mesh:
        with pytest.raises(RoutingUnavailable, match="no router"):
            await route(mesh.client)


async def test_route_and_admit_carry_the_lora_adapter_to_the_router() -> None:
    async with routers(OK) as mesh:
        await mesh.client.route("req-a", MODEL, TOKENS, DECODE, lora_name="sql-expert")
        choice, held = await mesh.client.admit("req-b", MODEL, TOKENS, Admit(common_pb2.Qos()), lora_name="sql-expert")
        held.release()
        base = await mesh.client.route("req-c", MODEL, TOKENS, DECODE)
        assert choice.worker_id == base.worker_id == "worker-via-r0"
        assert [r.lora_name for r in mesh["r0"].calls] == ["sql-expert", "sql-expert", ""]
        assert [r.hold for r in mesh["r0"].calls] == [False, True, False]
