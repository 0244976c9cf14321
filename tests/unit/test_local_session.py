"""In-process sessions (services/mesh/local_session.py): a hub's calls run by their caller's
process keep every rule of a session over gRPC (tests/unit/test_sessions.py, whose scripted
handler they call), and rows stay rows."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gen.kvmesh.v1 import common_pb2, processor_pb2, router_pb2
from services.mesh.local_session import LocalSession
from services.mesh.session_client import SessionLimits
from services.mesh.session_kind import PROCESSOR_SESSION, CallError, CallInfo
from services.mesh.session_server import SessionHub
from tests.unit.test_sessions import Scripted, replies


def local(limits: SessionLimits | None = None) -> tuple[Scripted, LocalSession]:
    servicer = Scripted()
    return servicer, LocalSession(servicer.sessions, "in-process", limits)


def call(session: LocalSession, rid: str, behaviour: str = "ok", count: int = 1, timeout_s: float | None = 10.0,
         metadata: tuple[tuple[str, str], ...] | None = None):
    return session.open(router_pb2.RouteRequest(request_id=rid, model=behaviour, token_ids=[count]), timeout_s,
                        metadata)


async def test_concurrent_calls_get_their_own_replies_in_order_with_their_metadata() -> None:
    servicer, session = local()
    streams = [call(session, f"r{i}", "lockstep", 20, metadata=(("traceparent", f"t{i}"),)) for i in range(30)]
    got = await asyncio.gather(*(replies(s) for s in streams))
    for i, answer in enumerate(got):
        assert answer == [f"r{i}:{k}" for k in range(20)]
        assert servicer.metadata[f"r{i}"] == {"traceparent": f"t{i}"}
    assert not session.streams and session.buffered == 0, "ended calls leave nothing behind"


async def test_errors_keep_their_outcome_and_come_after_the_replies_before_them() -> None:
    _, session = local()
    got = []
    with pytest.raises(CallError) as bad:
        async for reply in call(session, "bad", "bad", 3):
            got.append(reply.worker_id)
    assert got == ["bad:0", "bad:1", "bad:2"]
    assert (bad.value.outcome, bad.value.param) == (common_pb2.OUTCOME_BAD_REQUEST, "prompt")
    with pytest.raises(CallError) as busy:
        await replies(call(session, "busy", "busy", 0))
    assert busy.value.outcome == common_pb2.OUTCOME_PEER_DRAINING
    assert await replies(call(session, "after")) == ["after:0"]


async def test_a_handler_bug_fails_its_own_call_only() -> None:
    async def broken(request: router_pb2.RouteRequest, info: CallInfo) -> AsyncIterator[router_pb2.RouteResponse]:
        if request.request_id == "bug":
            raise KeyError("a bug")
        yield router_pb2.RouteResponse(worker_id="fine")

    servicer = Scripted()
    session = LocalSession(SessionHub(servicer.sessions.kind, broken), "in-process")
    with pytest.raises(CallError) as failed:
        await replies(call(session, "bug"))
    assert failed.value.outcome == common_pb2.OUTCOME_PEER_FAILED and "KeyError" in failed.value.message
    assert await replies(call(session, "ok")) == ["fine"]


async def test_a_cancelled_call_stops_its_handler_and_the_others_go_on() -> None:
    servicer, session = local()
    hung = call(session, "hung", "hang")
    other = call(session, "other", "gated", 2)
    await asyncio.wait_for(asyncio.gather(servicer.started["hung"].wait(), servicer.started["other"].wait()), 5)
    hung.cancel()
    await asyncio.wait_for(servicer.stopped["hung"].wait(), 5)
    servicer.gate.set()
    assert await replies(other) == ["other:0", "other:1"]
    with pytest.raises(CallError) as cancelled:
        await replies(hung)
    assert cancelled.value.outcome == common_pb2.OUTCOME_CANCELLED


async def test_a_deadline_ends_the_call_and_stops_its_handler() -> None:
    servicer, session = local()
    with pytest.raises(CallError) as late:
        await replies(call(session, "late", "hang", timeout_s=0.2))
    await asyncio.wait_for(servicer.stopped["late"].wait(), 5)
    assert late.value.outcome == common_pb2.OUTCOME_DEADLINE


async def test_a_consumer_that_reads_nothing_fails_its_own_call_only() -> None:
    servicer, session = local(SessionLimits(max_buffered_per_call=100))
    unread = call(session, "unread", "ok", 500)
    read = call(session, "read", "outlives-unread", 300)
    got = await asyncio.wait_for(servicer.read_reporting("read", read), 30)
    assert len(got) == 300
    with pytest.raises(CallError) as overflow:
        await replies(unread)
    assert overflow.value.outcome == common_pb2.OUTCOME_READ_TOO_SLOWLY


async def test_a_draining_hub_refuses_new_calls_and_finishes_open_ones() -> None:
    servicer, session = local()
    running = call(session, "running", "gated", 2)
    await asyncio.wait_for(servicer.started["running"].wait(), 5)
    servicer.sessions.drain()
    with pytest.raises(CallError) as refused:
        await replies(call(session, "late-comer"))
    assert refused.value.outcome == common_pb2.OUTCOME_PEER_DRAINING
    servicer.gate.set()
    assert await replies(running) == ["running:0", "running:1"]


async def test_closing_fails_open_calls_retryably_and_stops_their_handlers() -> None:
    servicer, session = local()
    open_calls = [call(session, f"h{i}", "hang") for i in range(3)]
    await asyncio.wait_for(asyncio.gather(*(servicer.started[f"h{i}"].wait() for i in range(3))), 5)
    await session.close()
    for i, stream in enumerate(open_calls):
        with pytest.raises(CallError) as gone:
            await replies(stream)
        assert gone.value.outcome == common_pb2.OUTCOME_PEER_GONE
        assert servicer.stopped[f"h{i}"].is_set()
    with pytest.raises(CallError):
        await replies(call(session, "after-close"))


async def test_rows_reach_the_caller_as_rows_from_the_handler_and_from_its_reply_hook() -> None:
    """A processor's text rows are the tuples a remote caller unpacks from a frame, whether the
    handler yields them or pushes them through CallInfo.reply; other replies stay messages."""
    async def handler(request: processor_pb2.GenerateRequest,
                      info: CallInfo) -> AsyncIterator[processor_pb2.GenerateResponse | tuple]:
        yield processor_pb2.GenerateResponse(route=processor_pb2.RouteInfo(worker_id="w"))
        yield (0, "Hel", [1, 2])
        assert info.reply is not None
        info.reply((0, "lo", [3]))
        await asyncio.sleep(0)
        yield processor_pb2.GenerateResponse(usage=processor_pb2.Usage(completion_tokens=3))

    session = LocalSession(SessionHub(PROCESSOR_SESSION, handler), "in-process")
    got = [m async for m in session.open(processor_pb2.GenerateRequest(request_id="x"), 5.0)]
    assert got[0].route.worker_id == "w"
    assert got[1:3] == [(0, "Hel", [1, 2]), (0, "lo", [3])]
    assert got[3].usage.completion_tokens == 3
