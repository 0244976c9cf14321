"""Text rows on the processor session (session_kind.TEXT_ROWS) and the row sinks that make them.

- columns round-trip every row (empty texts, multi-byte text, rows of several tokens) and a row's
  message form is the delta it stands for;
- over a real in-process gRPC server, replies a handler makes through `CallInfo.reply` reach a
  caller that announced rows as rows, in order with the messages the handler yields; a caller
  that did not announce them gets the same deltas as messages;
- `SessionStream._push_row` hands a row to the consumer's sink only while the consumer waits with
  nothing unread, so a row never overtakes a reply before it, and a row the sink declines is
  read like any reply;
- a long frame of text rows is handed out in slices of 128, in order, the loop running between.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import Any

import grpc

from gen.kvmesh.v1 import common_pb2, processor_pb2, processor_pb2_grpc
from services.mesh.channels import ChannelPool
from services.mesh.session_client import SessionPool, SessionStream
from services.mesh.session_kind import PROCESSOR_SESSION, TEXT_ROWS, CallInfo, TextRow, text_row_message
from services.mesh.session_server import SessionHub
from tests.unit.in_process_grpc import read_all, serving
from tests.unit.stand_ins import StandInSession

ROWS: list[TextRow] = [(0, "Hel", [5, 6]), (0, "", [7]), (0, "lo é", [8]), (3, "✓", [9, 10, 11])]


def test_text_rows_round_trip_through_their_columns() -> None:
    frame = processor_pb2.ProcessorSessionUp()
    TEXT_ROWS.pack(frame, [1, 1, 2, 7], ROWS)
    frame = processor_pb2.ProcessorSessionUp.FromString(frame.SerializeToString())
    assert list(TEXT_ROWS.unpack(frame)) == list(zip([1, 1, 2, 7], ROWS))
    assert list(TEXT_ROWS.unpack(processor_pb2.ProcessorSessionUp())) == []
    delta = text_row_message(ROWS[3]).delta
    assert (delta.index, delta.text, list(delta.token_ids), delta.finish_reason) == (
        3, "✓", [9, 10, 11], common_pb2.FINISH_REASON_UNSPECIFIED)


def first(i: int) -> processor_pb2.GenerateResponse:
    return processor_pb2.GenerateResponse(delta=processor_pb2.ChoiceDelta(index=0, text=f"<{i}>", token_ids=[i]))


def last(i: int) -> processor_pb2.GenerateResponse:
    return processor_pb2.GenerateResponse(
        delta=processor_pb2.ChoiceDelta(index=0, text=".", finish_reason=common_pb2.FINISH_REASON_STOP))


def rows_of(i: int) -> list[TextRow]:
    return [(0, f"{i}:{k}", [100 * i + k]) for k in range(5)]


class RowMaker(processor_pb2_grpc.ProcessorServicer):
    """Yields a first delta, then makes its rows through `CallInfo.reply` from another task (as the
    processor's row sink does where a worker's frame is read), then yields a last delta."""

    def __init__(self) -> None:
        self.sessions = SessionHub(PROCESSOR_SESSION, self.handle)

    async def Session(self, frames: AsyncIterator[processor_pb2.ProcessorSessionDown],  # noqa: N802
                      context: grpc.aio.ServicerContext) -> None:
        await self.sessions.serve(frames, context)

    async def handle(self, request: processor_pb2.GenerateRequest, call: CallInfo) -> AsyncIterator[Any]:
        i = int(request.request_id)
        yield first(i)
        assert call.reply is not None

        async def feed() -> None:
            for row in rows_of(i):
                call.reply(row)  # type: ignore[misc]
                await asyncio.sleep(0)

        await asyncio.create_task(feed())
        yield last(i)


def processor() -> AbstractAsyncContextManager[str]:
    return serving(processor_pb2_grpc.add_ProcessorServicer_to_server, RowMaker())



def as_text(reply: Any) -> tuple[str, str, list[int]]:
    if type(reply) is tuple:
        return "row", reply[1], reply[2]
    return "message", reply.delta.text, list(reply.delta.token_ids)


async def test_replies_made_through_call_reply_reach_a_row_reader_as_rows_in_order() -> None:
    async with processor() as address:
        channels = ChannelPool()
        sessions = SessionPool(channels)
        try:
            session = sessions.get(PROCESSOR_SESSION, address)
            calls = [session.open(processor_pb2.GenerateRequest(request_id=str(i)), 10) for i in range(20)]
            got = await asyncio.gather(*(read_all(c) for c in calls))
        finally:
            await sessions.close()
            await channels.close()
    for i, replies in enumerate(got):
        expected = [first(i), *rows_of(i), last(i)]
        assert [as_text(r)[1:] for r in replies] == [as_text(r)[1:] for r in expected], i
        assert [as_text(r)[0] for r in replies] == ["message", *["row"] * 5, "message"], i


async def test_a_caller_that_does_not_announce_rows_gets_the_same_deltas_as_messages() -> None:
    async with processor() as address:
        async with grpc.aio.insecure_channel(address) as channel:
            method = channel.stream_stream(PROCESSOR_SESSION.method,
                                           request_serializer=processor_pb2.ProcessorSessionDown.SerializeToString,
                                           response_deserializer=processor_pb2.ProcessorSessionUp.FromString)
            call = method()
            await call.write(processor_pb2.ProcessorSessionDown(calls=[
                processor_pb2.ProcessorCall(stream_id=1, request=processor_pb2.GenerateRequest(request_id="4"))]))
            replies: list[Any] = []
            while True:
                frame = await call.read()
                assert not frame.rows.stream_ids
                replies += [r.response for r in frame.replies]
                if frame.ends:
                    break
            await call.done_writing()
    assert [as_text(r)[1:] for r in replies] == [as_text(r)[1:] for r in [first(4), *rows_of(4), last(4)]]


async def test_a_row_reaches_the_sink_only_while_the_consumer_waits_with_nothing_unread() -> None:
    stream = SessionStream(1, StandInSession())  # type: ignore[arg-type]
    seen: list[tuple[str, str]] = []
    def sink(row: str) -> bool:
        if row == "r5":
            return False  # declined: buffered like any reply
        seen.append(("sink", row))
        return True

    stream.sink = sink
    stream._push_row("r0")  # the consumer has not started reading: buffered
    consumer_started = asyncio.Event()

    async def consume() -> None:
        consumer_started.set()
        async for item in stream:
            seen.append(("consumer", item))

    task = asyncio.create_task(consume())
    await consumer_started.wait()
    await asyncio.sleep(0)  # r0 read; the consumer waits
    stream._push_row("r1")  # to the sink
    stream._push("m1")  # buffered: the consumer is woken but has not run
    stream._push_row("r2")  # must not overtake m1: buffered behind it
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    stream._push_row("r3")  # the consumer waits again: to the sink
    stream._push_row("r5")  # declined by the sink: the consumer reads it
    await asyncio.sleep(0)
    stream._finish(None)
    stream._push_row("r4")  # after the end: dropped
    await asyncio.wait_for(task, 5)
    assert seen == [("consumer", "r0"), ("sink", "r1"), ("consumer", "m1"), ("consumer", "r2"), ("sink", "r3"),
                    ("consumer", "r5")]


async def test_a_sink_that_raises_fails_its_own_call_only_with_what_it_raised() -> None:
    async with processor() as address:
        channels = ChannelPool()
        sessions = SessionPool(channels)
        try:
            session = sessions.get(PROCESSOR_SESSION, address)
            broken = session.open(processor_pb2.GenerateRequest(request_id="1"), 10)
            fine = session.open(processor_pb2.GenerateRequest(request_id="2"), 10)

            def bad_sink(row: TextRow) -> bool:
                raise ValueError(f"cannot take {row[1]!r}")

            async def read_with_bad_sink() -> list[Any]:
                got = []
                async for reply in broken:
                    got.append(reply)
                    broken.sink = bad_sink
                return got

            outcome, replies = await asyncio.gather(read_with_bad_sink(), read_all(fine), return_exceptions=True)
        finally:
            await sessions.close()
            await channels.close()
    assert isinstance(outcome, ValueError) and "cannot take '1:" in str(outcome)
    assert [as_text(r)[1] for r in replies] == [as_text(r)[1] for r in [first(2), *rows_of(2), last(2)]]


class ManyRows(RowMaker):
    """A first delta, then 300 rows made at once (one frame), then a last delta. The caller (on
    the same loop) says when it has read the first delta and when it has taken the last row."""

    def __init__(self) -> None:
        super().__init__()
        self.first_read = asyncio.Event()
        self.rows_taken = asyncio.Event()

    async def handle(self, request: processor_pb2.GenerateRequest, call: CallInfo) -> AsyncIterator[Any]:
        yield first(0)
        await asyncio.wait_for(self.first_read.wait(), 10)  # the first delta left in a frame of its own
        assert call.reply is not None
        for k in range(300):
            call.reply((0, f"r{k}", [k]))  # type: ignore[misc]
        await asyncio.wait_for(self.rows_taken.wait(), 10)  # the rows left in their own frame, before the last delta
        yield last(0)


async def test_a_gateway_hands_a_long_frame_of_text_rows_out_in_slices_in_order() -> None:
    """A gateway's sink writes each row to a socket: the loop runs again every 128 rows."""
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    seen: list[tuple[str, int]] = []
    maker = ManyRows()
    async with serving(processor_pb2_grpc.add_ProcessorServicer_to_server, maker) as address:
        channels = ChannelPool()
        sessions = SessionPool(channels)
        ticker = asyncio.create_task(tick())
        try:
            call = sessions.get(PROCESSOR_SESSION, address).open(processor_pb2.GenerateRequest(request_id="0"), 10)

            def sink(row: TextRow) -> bool:
                seen.append((row[1], ticks))
                if len(seen) == 300:
                    maker.rows_taken.set()
                return True

            assert as_text(await anext(call))[1] == "<0>"
            call.sink = sink
            maker.first_read.set()
            rest = await asyncio.wait_for(read_all(call), 30)
        finally:
            ticker.cancel()
            await sessions.close()
            await channels.close()
    assert [text for text, _ in seen] == [f"r{k}" for k in range(300)]
    assert [as_text(r)[1] for r in rest] == ["."]
    at = [t for _, t in seen]
    assert at[0] == at[127] < at[128] == at[255] < at[256] == at[299]
