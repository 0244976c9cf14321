"""The TCP carrier of sessions (services/mesh/session_carrier.py): where it is used, and where a
session falls back to the gRPC stream (a peer without it, a port that cannot be reached, a hello
it refuses). Real servers on 127.0.0.1 in this process; the session rules on both carriers are
tests/unit/test_sessions.py's."""

from __future__ import annotations

import asyncio
import logging
import struct

import grpc
import pytest

from gen.kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.mesh.channels import ChannelPool
from services.mesh.net import free_port
from services.mesh.session_carrier import (
    MAX_FRAME_BYTES,
    UNREACHABLE_RETRY_S,
    CarrierDialer,
    CarrierListener,
    endpoint_binding,
    read_frame,
)
from services.mesh.session_client import SessionPool
from services.mesh.session_kind import ROUTER_SESSION, CallError
from tests.unit.test_sessions import Scripted, replies


async def _served(servicer: Scripted, endpoint_port: int | None,
                  listener: CarrierListener | None = None) -> tuple[grpc.aio.Server, str]:
    """A router servicer on gRPC; `endpoint_port` None: no SessionCarrier service at all."""
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    if listener is not None:
        endpoint_port = await listener.start("127.0.0.1")
    if endpoint_port is not None:
        binding = endpoint_binding(endpoint_port)
        binding.add_to_server(binding.servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    return server, address


async def _call_once(address: str) -> tuple[str, list[str]]:
    channels = ChannelPool()
    pool = SessionPool(channels, dialer=CarrierDialer(channels))
    try:
        session = pool.get(ROUTER_SESSION, address)
        got = await replies(session.open(router_pb2.RouteRequest(request_id="r", model="ok", token_ids=[2]), 10))
        return session.carrier, got
    finally:
        await pool.close()
        await channels.close()


@pytest.fixture
def scripted() -> Scripted:
    return Scripted()


async def test_a_peer_that_offers_the_carrier_gets_its_sessions_over_tcp(scripted: Scripted) -> None:
    listener = CarrierListener([scripted.sessions])
    server, address = await _served(scripted, None, listener)
    try:
        assert await _call_once(address) == ("tcp", ["r:0", "r:1"])
    finally:
        await server.stop(None)
        await listener.stop(0)


@pytest.mark.parametrize("offer", ["no SessionCarrier service", "port 0"])
async def test_a_peer_without_the_carrier_gets_its_sessions_over_grpc(offer: str, scripted: Scripted) -> None:
    server, address = await _served(scripted, None if offer == "no SessionCarrier service" else 0)
    try:
        assert await _call_once(address) == ("grpc", ["r:0", "r:1"])
    finally:
        await server.stop(None)


async def test_a_port_that_cannot_be_reached_falls_back_to_grpc_and_says_so(
        caplog: pytest.LogCaptureFixture, scripted: Scripted) -> None:
    server, address = await _served(scripted, free_port())  # nothing listens there
    try:
        with caplog.at_level(logging.WARNING, "services.mesh.session_carrier"):
            assert await _call_once(address) == ("grpc", ["r:0", "r:1"])
        assert any("over gRPC instead" in r.getMessage() for r in caplog.records)
    finally:
        await server.stop(None)


async def test_a_hello_for_a_method_the_listener_does_not_serve_is_closed_without_an_answer(
        scripted: Scripted) -> None:
    listener = CarrierListener([scripted.sessions])
    port = await listener.start("127.0.0.1")
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        method = b"kvmesh.v1.Worker/Session"
        writer.write(struct.pack("<I", len(method)) + method)
        await writer.drain()
        assert await asyncio.wait_for(read_frame(reader, 16), 5) is None, "closed, no ACCEPTED"
        writer.close()
    finally:
        await listener.stop(0)


async def test_a_frame_over_the_limit_ends_the_connection(scripted: Scripted) -> None:
    listener = CarrierListener([scripted.sessions])
    port = await listener.start("127.0.0.1")
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        method = ROUTER_SESSION.method.encode()
        writer.write(struct.pack("<I", len(method)) + method)
        assert await asyncio.wait_for(read_frame(reader, 16), 5) == b"\x01"
        writer.write(struct.pack("<I", MAX_FRAME_BYTES + 1))  # a header announcing too much
        await writer.drain()
        assert await asyncio.wait_for(read_frame(reader, 16), 5) is None, "the server closed the session"
        writer.close()
    finally:
        await listener.stop(0)


async def test_a_port_that_failed_is_not_tried_again_until_the_retry_time(scripted: Scripted) -> None:
    port = free_port()
    server, address = await _served(scripted, port)
    now = [100.0]
    channels = ChannelPool()
    dialer = CarrierDialer(channels, clock=lambda: now[0])
    knocks: list[int] = []

    async def count(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        knocks.append(1)
        writer.close()  # no hello answered: the dialer falls back again

    try:
        assert await dialer.open(address, ROUTER_SESSION.method, ROUTER_SESSION.up) is None  # refused: remembered
        knocker = await asyncio.start_server(count, "127.0.0.1", port)
        now[0] += UNREACHABLE_RETRY_S - 1
        assert await dialer.open(address, ROUTER_SESSION.method, ROUTER_SESSION.up) is None
        assert knocks == [], "within the retry time the port is not tried"
        now[0] += 2
        assert await dialer.open(address, ROUTER_SESSION.method, ROUTER_SESSION.up) is None
        assert knocks == [1], "past it, it is tried again"
        knocker.close()
    finally:
        await channels.close()
        await server.stop(None)


async def test_a_peer_that_answers_the_hello_then_goes_silent_is_taken_for_gone(monkeypatch: pytest.MonkeyPatch,
                                                                               scripted: Scripted) -> None:
    """A stopped peer process whose kernel still acknowledges: the heartbeat finds it, and the
    session's calls fail retryably instead of waiting for their deadlines."""
    monkeypatch.setattr("services.mesh.session_carrier.HEARTBEAT_S", 0.05)
    monkeypatch.setattr("services.mesh.session_carrier.SILENT_PEER_S", 0.3)
    held: list[asyncio.StreamWriter] = []

    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_frame(reader, 256)
        writer.write(struct.pack("<I", 1) + b"\x01")  # ACCEPTED, then nothing ever again
        held.append(writer)

    silent = await asyncio.start_server(mute, "127.0.0.1", 0)
    server, address = await _served(scripted, silent.sockets[0].getsockname()[1])
    channels = ChannelPool()
    pool = SessionPool(channels, dialer=CarrierDialer(channels))
    try:
        session = pool.get(ROUTER_SESSION, address)
        stream = session.open(router_pb2.RouteRequest(request_id="r", model="ok", token_ids=[1]), 30)
        with pytest.raises(CallError) as gone:
            await asyncio.wait_for(replies(stream), 10)
        assert gone.value.outcome == common_pb2.OUTCOME_PEER_GONE and session.carrier == "tcp"
    finally:
        await pool.close()
        await channels.close()
        await server.stop(None)
        silent.close()
        for writer in held:
            writer.close()
