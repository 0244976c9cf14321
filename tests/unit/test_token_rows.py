"""Token rows on the worker session (session_kind.ReplyRows) over a real in-process gRPC server:
a caller that announces rows gets a call's plain replies as rows and the rest as messages, every
call's replies in order whatever shares a frame; a caller that does not gets messages only."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager

import grpc

from gen.kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.mesh.channels import ChannelPool
from services.mesh.session_client import SessionPool
from services.mesh.session_kind import OK, WORKER_SESSION, CallInfo, TokenRow
from services.mesh.session_server import SessionHub
from tests.unit.in_process_grpc import serving

Reply = worker_pb2.WorkerGenerateResponse | TokenRow


def script(call: int) -> list[Reply]:
    """What the handler yields for a call: a first message, rows, a message with logprobs between
    rows (which must not overtake the rows before it nor be overtaken by those after), a last."""
    base = 1000 * call
    return [
        worker_pb2.WorkerGenerateResponse(token_ids=[base], prompt_tokens=5),
        [base + 1],
        [base + 2, base + 3],
        worker_pb2.WorkerGenerateResponse(token_ids=[base + 4], logprobs=[common_pb2.TokenLogprob(token_id=base + 4)]),
        [base + 5],
        [base + 6],
        worker_pb2.WorkerGenerateResponse(token_ids=[base + 7], finish_reason=common_pb2.FINISH_REASON_LENGTH),
    ]


class Scripted(worker_pb2_grpc.WorkerServicer):
    def __init__(self, handshake: bool = False) -> None:
        """`handshake`: after a message, wait until the caller (on this loop) has read it."""
        self.sessions = SessionHub(WORKER_SESSION, self.handle)
        self.handshake = handshake
        self.read: dict[int, int] = {}  # per call, the replies its caller has read
        self.progress = asyncio.Condition()

    async def caller_read(self, call: int) -> None:
        async with self.progress:
            self.read[call] = self.read.get(call, 0) + 1
            self.progress.notify_all()

    async def Session(self, frames: AsyncIterator[worker_pb2.WorkerSessionDown],  # noqa: N802
                      context: grpc.aio.ServicerContext) -> None:
        await self.sessions.serve(frames, context)

    async def handle(self, request: worker_pb2.WorkerGenerateRequest, call: CallInfo) -> AsyncIterator[Reply]:
        rid = int(request.request_id)
        for sent, reply in enumerate(script(rid), start=1):
            yield reply
            # Lockstep, so the calls' replies interleave in shared frames; after a message, until
            # its caller has read it (it left first), so the rows after it can travel as rows.
            await asyncio.sleep(0)
            if self.handshake and not isinstance(reply, list):
                async with self.progress:
                    await self.progress.wait_for(lambda: self.read.get(rid, 0) >= sent)  # noqa: B023


def worker(scripted: Scripted | None = None) -> AbstractAsyncContextManager[str]:
    return serving(worker_pb2_grpc.add_WorkerServicer_to_server, scripted or Scripted())



def as_tokens(reply: Reply) -> tuple[str, list[int]]:
    return ("row", list(reply)) if isinstance(reply, list) else ("message", list(reply.token_ids))


async def test_a_caller_that_reads_rows_gets_plain_replies_as_rows_in_order() -> None:
    scripted = Scripted(handshake=True)

    async def read_all(i: int, call: AsyncIterator[Reply]) -> list[Reply]:
        got = []
        async for reply in call:
            got.append(reply)
            await scripted.caller_read(i)
        return got

    async with worker(scripted) as address:
        channels = ChannelPool()
        sessions = SessionPool(channels)
        try:
            session = sessions.get(WORKER_SESSION, address)
            calls = [session.open(worker_pb2.WorkerGenerateRequest(request_id=str(i)), 10) for i in range(40)]
            got = await asyncio.wait_for(asyncio.gather(*(read_all(i, c) for i, c in enumerate(calls))), 30)
            frames = session.frames_received
        finally:
            await sessions.close()
            await channels.close()
    rows = 0
    for i, replies in enumerate(got):
        sent = script(i)
        assert [as_tokens(r)[1] for r in replies] == [as_tokens(r)[1] for r in sent], i
        for got_reply, sent_reply in zip(replies, sent, strict=True):
            # A message stays a message; a row is a row, or a message where it followed one of its
            # call's messages in one frame (the frame rule, tested exactly below).
            assert not isinstance(sent_reply, worker_pb2.WorkerGenerateResponse) or not isinstance(got_reply, list)
            rows += isinstance(got_reply, list)
        assert replies[3].logprobs[0].token_id == 1000 * i + 4 and replies[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert rows == 40 * 4, f"plain replies travel as rows ({rows} of {40 * 4})"
    assert frames < 40 * 7 / 2, "the calls' replies share frames"


async def test_a_caller_that_does_not_announce_rows_gets_every_reply_as_a_message() -> None:
    async with worker() as address:
        async with grpc.aio.insecure_channel(address) as channel:
            method = channel.stream_stream(WORKER_SESSION.method,
                                           request_serializer=worker_pb2.WorkerSessionDown.SerializeToString,
                                           response_deserializer=worker_pb2.WorkerSessionUp.FromString)
            call = method()
            await call.write(worker_pb2.WorkerSessionDown(calls=[
                worker_pb2.WorkerCall(stream_id=sid, request=worker_pb2.WorkerGenerateRequest(request_id=str(sid)))
                for sid in (1, 2)]))
            replies: dict[int, list[list[int]]] = {1: [], 2: []}
            ended: set[int] = set()
            while ended != {1, 2}:
                frame = await call.read()
                assert not frame.rows.stream_ids
                for reply in frame.replies:
                    replies[reply.stream_id].append(list(reply.response.token_ids))
                for end in frame.ends:
                    assert end.outcome == OK
                    ended.add(end.stream_id)
            await call.done_writing()
    for sid, got in replies.items():
        assert got == [as_tokens(r)[1] for r in script(sid)]


def test_in_one_frame_a_calls_rows_after_one_of_its_messages_travel_as_messages() -> None:
    """Within a frame rows are read before messages: a row that follows one of its call's
    messages must not overtake it."""
    from services.mesh.session_server import _ServerSession

    session = _ServerSession(SessionHub(WORKER_SESSION, Scripted().handle), context=None)  # type: ignore[arg-type]
    session.accepts_rows = True
    sent: list[tuple[int, Reply]] = []
    for i in range(3):
        sent += [(1, [10 + i]), (2, [20 + i])]
    sent.insert(2, (1, worker_pb2.WorkerGenerateResponse(token_ids=[99], finish_reason=common_pb2.FINISH_REASON_STOP)))
    frame = worker_pb2.WorkerSessionUp()
    session._fill(frame, sent)
    received: dict[int, list[tuple[str, list[int]]]] = {1: [], 2: []}
    for sid, row in WORKER_SESSION.rows.unpack(frame):  # type: ignore[union-attr]
        received[sid].append(as_tokens(row))
    for reply in frame.replies:
        received[reply.stream_id].append(as_tokens(reply.response))
    for sid in (1, 2):
        assert [tokens for _, tokens in received[sid]] == [as_tokens(r)[1] for s, r in sent if s == sid]
    assert [kind for kind, _ in received[1]] == ["row", "message", "message", "message"]
    assert [kind for kind, _ in received[2]] == ["row", "row", "row"]
