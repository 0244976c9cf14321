"""Multiplexed sessions (services/mesh/session_*.py) over a real in-process gRPC server.

The server is a real `grpc.aio` server on 127.0.0.1 whose `Session` is a `SessionHub`; the
client is a real `SessionPool`. The handler follows the request: `request_id` names a behaviour,
`token_ids[0]` how many responses to give. No etcd and no child process: seconds for the file.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc
import pytest

from gen.kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.mesh.channels import ChannelPool
from services.mesh.session_carrier import CarrierDialer, CarrierListener, endpoint_binding
from services.mesh.session_client import SessionLimits, SessionPool
from services.mesh.session_kind import ROUTER_SESSION, CallError, CallInfo, bad_request
from services.mesh.session_server import SessionHub
from tests.procs import eventually


@dataclass
class Scripted(router_pb2_grpc.RouterServicer):
    # Set once the handler of a call (by request id) runs, and once it stopped being run: ended,
    # failed or cancelled.
    started: defaultdict[str, asyncio.Event] = field(default_factory=lambda: defaultdict(asyncio.Event))
    stopped: dict[str, asyncio.Event] = field(default_factory=dict)
    # Released to let "gated" calls finish.
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    metadata: dict[str, dict[str, str]] = field(default_factory=dict)
    # Per call, the replies its caller has read, where the test reports them (`read_reporting`).
    read: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    progress: asyncio.Condition = field(default_factory=asyncio.Condition)

    def __post_init__(self) -> None:
        self.sessions = SessionHub(ROUTER_SESSION, self.handle)

    async def read_reporting(self, rid: str, stream) -> list[str]:  # noqa: ANN001 - a session call
        got = []
        async for reply in stream:
            got.append(reply.worker_id)
            async with self.progress:
                self.read[rid] += 1
                self.progress.notify_all()
        return got

    async def Session(self, frames: AsyncIterator[router_pb2.RouterSessionDown],  # noqa: N802
                      context: grpc.aio.ServicerContext) -> None:
        await self.sessions.serve(frames, context)

    async def handle(self, request: router_pb2.RouteRequest, call: CallInfo) -> AsyncIterator[router_pb2.RouteResponse]:
        rid, behaviour = request.request_id, request.model
        self.metadata[rid] = dict(call.metadata)
        stopped = self.stopped.setdefault(rid, asyncio.Event())
        self.started[rid].set()
        try:
            count = request.token_ids[0] if request.token_ids else 1
            if behaviour == "hang":
                await asyncio.Event().wait()
            if behaviour == "gated":
                await self.gate.wait()
            for i in range(count):
                yield router_pb2.RouteResponse(worker_id=f"{rid}:{i}")
                if behaviour == "lockstep":
                    await asyncio.sleep(0)
                elif behaviour == "outlives-unread":
                    if i == count // 2:
                        # Halfway, until the call "unread" has ended here: the rest of this
                        # call's replies leave behind all of that one's.
                        await self.stopped.setdefault("unread", asyncio.Event()).wait()
                    if (i + 1) % 50 == 0:
                        # A reading caller, never more than 50 replies behind.
                        async with self.progress:
                            await self.progress.wait_for(lambda: self.read[rid] > i)  # noqa: B023
            if behaviour == "bad":
                raise bad_request("scripted bad request", "prompt")
            if behaviour == "busy":
                raise CallError(common_pb2.OUTCOME_PEER_DRAINING, "scripted retry elsewhere")
        finally:
            stopped.set()


@dataclass
class Bed:
    servicer: Scripted
    server: grpc.aio.Server
    address: str
    sessions: SessionPool
    listener: CarrierListener | None = None

    async def stop_server(self) -> None:
        """The peer goes away: its gRPC server and its TCP carrier."""
        await self.server.stop(None)
        if self.listener is not None:
            await self.listener.stop(0)

    def open(self, rid: str, behaviour: str = "ok", count: int = 1, timeout_s: float | None = 10.0,
             metadata: tuple[tuple[str, str], ...] | None = None):
        request = router_pb2.RouteRequest(request_id=rid, model=behaviour, token_ids=[count])
        return self.sessions.get(ROUTER_SESSION, self.address).open(request, timeout_s, metadata)

    async def running(self, *rids: str) -> None:
        """Returns once the server runs the handler of each of these calls."""
        await asyncio.wait_for(asyncio.gather(*(self.servicer.started[rid].wait() for rid in rids)), 5)


@pytest.fixture(params=["grpc", "tcp"])
def carrier(request: pytest.FixtureRequest) -> str:
    """Every rule holds on both carriers of a session (session_carrier.py)."""
    return request.param


@asynccontextmanager
async def bed(limits: SessionLimits | None = None, carrier: str = "grpc") -> AsyncIterator[Bed]:
    servicer = Scripted()
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    listener = None
    if carrier == "tcp":
        listener = CarrierListener([servicer.sessions])
        binding = endpoint_binding(await listener.start("127.0.0.1"))
        binding.add_to_server(binding.servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    channels = ChannelPool()
    sessions = SessionPool(channels, limits, CarrierDialer(channels) if carrier == "tcp" else None)
    b = Bed(servicer, server, address, sessions, listener)
    try:
        yield b
    finally:
        await sessions.close()
        await channels.close()
        await b.stop_server()


async def replies(stream) -> list[str]:
    return [r.worker_id async for r in stream]


async def test_concurrent_calls_share_one_stream_and_frames_carry_many_replies(carrier: str) -> None:
    async with bed(carrier=carrier) as b:
        streams = [b.open(f"r{i}", "lockstep", 20) for i in range(50)]
        got = await asyncio.gather(*(replies(s) for s in streams))
        session = b.sessions.get(ROUTER_SESSION, b.address)
        frames = session.frames_received
    for i, answer in enumerate(got):
        assert answer == [f"r{i}:{k}" for k in range(20)], "each call gets its own replies, in order"
    # 1000 replies and 50 ends in far fewer frames: replies of concurrent calls share them.
    assert frames < 200, frames


async def test_a_call_carries_its_own_trace_metadata(carrier: str) -> None:
    async with bed(carrier=carrier) as b:
        await replies(b.open("traced", metadata=(("traceparent", "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"),)))
        await replies(b.open("untraced"))
    assert b.servicer.metadata["traced"] == {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"}
    assert b.servicer.metadata["untraced"] == {}


async def test_errors_keep_their_outcome_and_field(carrier: str) -> None:
    async with bed(carrier=carrier) as b:
        with pytest.raises(CallError) as bad:
            await replies(b.open("bad", "bad", 2))
        with pytest.raises(CallError) as busy:
            await replies(b.open("busy", "busy", 0))
        # The session survives its calls' failures.
        assert await replies(b.open("after")) == ["after:0"]
    assert (bad.value.outcome, bad.value.message, bad.value.param) == (
        common_pb2.OUTCOME_BAD_REQUEST, "scripted bad request", "prompt")
    assert busy.value.outcome == common_pb2.OUTCOME_PEER_DRAINING


async def test_replies_before_a_failure_are_delivered_before_it(carrier: str) -> None:
    async with bed(carrier=carrier) as b:
        stream = b.open("partial", "bad", 3)
        got = []
        with pytest.raises(CallError):
            async for reply in stream:
                got.append(reply.worker_id)
    assert got == ["partial:0", "partial:1", "partial:2"]


async def test_a_cancelled_call_stops_at_the_server_and_the_others_go_on(carrier: str) -> None:
    async with bed(carrier=carrier) as b:
        hung = b.open("hung", "hang")
        other = b.open("other", "gated", 3)
        await b.running("hung", "other")
        hung.cancel()
        await asyncio.wait_for(b.servicer.stopped["hung"].wait(), 5)
        b.servicer.gate.set()
        assert await replies(other) == ["other:0", "other:1", "other:2"]
        with pytest.raises(CallError) as cancelled:
            await replies(hung)
    assert cancelled.value.outcome == common_pb2.OUTCOME_CANCELLED


async def test_a_deadline_ends_the_call_here_and_at_the_server(carrier: str) -> None:
    async with bed(carrier=carrier) as b:
        with pytest.raises(CallError) as late:
            await replies(b.open("late", "hang", timeout_s=0.3))
        await asyncio.wait_for(b.servicer.stopped["late"].wait(), 5)
    assert late.value.outcome == common_pb2.OUTCOME_DEADLINE


async def test_a_broken_session_fails_every_open_call_retryably_and_the_next_call_gets_a_new_one(carrier: str) -> None:
    async with bed(carrier=carrier) as b:
        open_calls = [b.open(f"h{i}", "hang") for i in range(5)]
        await b.running(*(f"h{i}" for i in range(5)))
        first = b.sessions.get(ROUTER_SESSION, b.address)
        await b.stop_server()  # the peer goes away with five calls open
        for stream in open_calls:
            with pytest.raises(CallError) as broken:
                await asyncio.wait_for(replies(stream), 5)
            assert broken.value.outcome == common_pb2.OUTCOME_PEER_GONE
        assert first.closed
        assert b.sessions.get(ROUTER_SESSION, b.address) is not first


async def test_a_consumer_that_reads_nothing_fails_its_own_call_only(carrier: str) -> None:
    async with bed(SessionLimits(max_buffered_per_call=100), carrier=carrier) as b:
        unread = b.open("unread", "ok", 500)
        read = b.open("read", "outlives-unread", 300)
        got = await asyncio.wait_for(b.servicer.read_reporting("read", read), 30)
        assert len(got) == 300, "a slow consumer never stalls the other calls of its session"
        with pytest.raises(CallError) as overflow:
            await replies(unread)
    assert overflow.value.outcome == common_pb2.OUTCOME_READ_TOO_SLOWLY


async def test_a_drain_refuses_new_calls_finishes_open_ones_then_ends_the_session(carrier: str) -> None:
    async with bed(carrier=carrier) as b:
        running = b.open("running", "gated", 2)
        await b.running("running")
        session = b.sessions.get(ROUTER_SESSION, b.address)
        b.servicer.sessions.drain()
        with pytest.raises(CallError) as refused:
            await replies(b.open("late-comer"))
        b.servicer.gate.set()
        assert await replies(running) == ["running:0", "running:1"]
        # Checked inside the block: leaving it closes every session anyway.
        assert await eventually(lambda: session.closed, 5), "a drained session ends once its calls have"
    assert refused.value.outcome == common_pb2.OUTCOME_PEER_DRAINING
