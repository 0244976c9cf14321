"""The serving end of multiplexed sessions (session_kind.py): many calls over one stream.

`SessionHub` serves a service's `Session` method with the same handler as its per-request RPC:
an async generator from (request, CallInfo) to responses that raises `CallError` for an answer
other than OK. Per session it runs every call as its own task and writes what the calls produce
through one writer: replies and ends pile up in an outbox while a frame is being written and go
out together in the next frame, so a frame is flushed once per event-loop turn at most and
requests on the same pair share frames without waiting for each other.

Bounds and what happens at them:
- calls open on one session: `max_calls`; a call past it ends OUTCOME_SESSION_FULL at once;
- the outbox: `max_outbox` entries; a peer that reads none of them for that long is treated as
  gone: the session ends, its calls are cancelled (the caller migrates them).
A caller that leaves (its session breaks or it half-closes) cancels every call it had open.
A drain (`drain()`) refuses new calls with OUTCOME_PEER_DRAINING, which callers retry elsewhere, lets those
in flight finish, then ends each session once it has nothing open (a handler that would wait for
ever waits on `drained` instead).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import grpc

from gen.kvmesh.v1 import common_pb2
from services.mesh.hop_latency import HopLatency
from services.mesh.session_kind import OK, CallError, CallInfo, SessionKind

log = logging.getLogger(__name__)

Handler = Callable[[Any, CallInfo], AsyncIterator[Any]]

MAX_CALLS_PER_SESSION = 65536
MAX_OUTBOX = 1 << 20
# Replies per frame: a frame stays far below the gRPC message limit even with large replies.
MAX_REPLIES_PER_FRAME = 4096


class SessionHub:
    """Every session of one service in this process."""

    def __init__(self, kind: SessionKind, handler: Handler, *, max_calls: int = MAX_CALLS_PER_SESSION,
                 max_outbox: int = MAX_OUTBOX, latency: HopLatency | None = None) -> None:
        """`latency`: where this hop records the time from a reply's origin to its frame's write."""
        self.kind = kind
        self.handler = handler
        self.latency = latency
        self._max_calls = max_calls
        self._max_outbox = max_outbox
        self._sessions: set[_ServerSession] = set()
        self.draining = False
        # Set at the drain: a handler whose call would otherwise never end by itself (a router's
        # held route, which only counts a place) ends when it is set.
        self.drained = asyncio.Event()
        self._on_drain: list[Callable[[], None]] = []

    async def serve(self, frames: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> None:
        """The body of the service's `Session` method."""
        session = _ServerSession(self, context)
        self._sessions.add(session)
        try:
            await session.run(frames)
        finally:
            self._sessions.discard(session)

    def on_drain(self, listener: Callable[[], None]) -> None:
        """Called at the drain (a router's queue sends its waiters elsewhere)."""
        self._on_drain.append(listener)

    def drain(self) -> None:
        """Refuses new calls from now on; each session ends once its calls have."""
        self.draining = True
        self.drained.set()
        for listener in self._on_drain:
            listener()
        for session in list(self._sessions):
            session.maybe_close()


class _ServerSession:
    def __init__(self, hub: SessionHub, context: grpc.aio.ServicerContext) -> None:
        self.hub = hub
        self.context = context
        self.calls: dict[int, asyncio.Task[None]] = {}
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._replies: list[tuple[int, Any]] = []
        # The origin (hop_latency.py) of the oldest reply waiting; 0 while none waits.
        self._origin_ns = 0
        self._ends: list[common_pb2.StreamEnd] = []
        self._wake = asyncio.Event()
        self._closing = False
        # The caller reads rows (session_kind.ReplyRows): it said so on its first frame.
        self.accepts_rows = False

    async def run(self, frames: AsyncIterator[Any]) -> None:
        reader = asyncio.create_task(self._read(frames), name=f"{self.hub.kind.name} session reader")
        writer = asyncio.create_task(self._write(), name=f"{self.hub.kind.name} session writer")
        self.maybe_close()
        try:
            await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            calls = list(self.calls.values())
            for task in (reader, writer, *calls):
                task.cancel()
            await asyncio.gather(reader, writer, *calls, return_exceptions=True)
        if writer.done() and not writer.cancelled() and writer.exception() is not None:
            log.info("%s session ended: %s", self.hub.kind.name, writer.exception())

    # -- frames from the caller ------------------------------------------------------------------

    async def _read(self, frames: AsyncIterator[Any]) -> None:
        """Until the caller half-closes or goes: then `run` cancels everything it had open."""
        rows = self.hub.kind.rows
        async for frame in frames:
            if rows is not None and frame.accepts_rows:
                self.accepts_rows = True
            for call in frame.calls:
                self._open(call)
            for stream_id in frame.cancel:
                task = self._forget(stream_id)
                if task is not None:
                    task.cancel()
            if self._closing:
                return

    def _open(self, call: Any) -> None:
        sid = call.stream_id
        if self.hub.draining:
            self._end(CallError(common_pb2.OUTCOME_PEER_DRAINING, "the server is draining").to_end(sid))
            self.maybe_close()
        elif len(self.calls) >= self.hub._max_calls:
            self._end(CallError(common_pb2.OUTCOME_SESSION_FULL,
                                f"{len(self.calls)} calls already open on this session").to_end(sid))
        elif sid in self.calls:
            self._end(CallError(common_pb2.OUTCOME_BAD_REQUEST, f"stream id {sid} is already open").to_end(sid))
        else:
            self.calls[sid] = asyncio.create_task(self._serve_call(sid, call.request, dict(call.metadata)))
            if call.timeout_ms:
                # A timer per call, cancelled when it ends (cheaper than a timeout context).
                self._timers[sid] = asyncio.get_running_loop().call_later(call.timeout_ms / 1000, self._expire, sid,
                                                                          call.timeout_ms)

    def _forget(self, sid: int) -> asyncio.Task[None] | None:
        """Drops a call and its deadline timer; returns its task, if it was still open."""
        timer = self._timers.pop(sid, None)
        if timer is not None:
            timer.cancel()
        return self.calls.pop(sid, None)

    def _expire(self, sid: int, timeout_ms: int) -> None:
        task = self._forget(sid)
        if task is not None:
            task.cancel()
            self._end(CallError(common_pb2.OUTCOME_DEADLINE,
                                f"the call took longer than its {timeout_ms / 1000:.1f}s deadline").to_end(sid))

    async def _serve_call(self, sid: int, request: Any, metadata: dict[str, str]) -> None:
        try:
            async for response in self.hub.handler(request, CallInfo(metadata, partial(self._reply_open, sid))):
                self._reply(sid, response)
            end = common_pb2.StreamEnd(stream_id=sid, outcome=OK)
        except CallError as exc:
            end = exc.to_end(sid)
        except Exception as exc:  # noqa: BLE001 - a bug in one call must not end the others
            log.exception("%s session: call %d failed", self.hub.kind.name, sid)
            end = CallError(common_pb2.OUTCOME_PEER_FAILED, f"{type(exc).__name__}: {exc}").to_end(sid)
        finally:
            # Cancelled (by the caller, the session's end, or the deadline, which ends the call
            # itself): no end from here.
            self._forget(sid)
        self._end(end)
        self.maybe_close()

    # -- frames to the caller ------------------------------------------------------------------

    def _reply(self, sid: int, response: Any) -> None:
        """A reply for the next frame. Its origin (hop_latency.py) is that frame's when it is the
        oldest: the first reply waiting, or one made of an upstream frame written earlier."""
        latency = self.hub.latency
        if latency is not None and (not self._origin_ns or latency.upstream_reading()):
            origin = latency.origin_ns()
            if not self._origin_ns or origin < self._origin_ns:
                self._origin_ns = origin
        self._replies.append((sid, response))
        self._wake.set()

    def _reply_open(self, sid: int, response: Any) -> None:
        """A reply from outside the call's task (CallInfo.reply): dropped once the call ended
        (cancelled or expired while its task had not run yet)."""
        if sid in self.calls:
            self._reply(sid, response)

    def _end(self, end: common_pb2.StreamEnd) -> None:
        self._ends.append(end)
        self._wake.set()

    def maybe_close(self) -> None:
        if self.hub.draining and not self.calls:
            self._closing = True
            self._wake.set()

    async def _write(self) -> None:
        up_type = self.hub.kind.up
        while True:
            if not self._replies and not self._ends:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            if len(self._replies) + len(self._ends) > self.hub._max_outbox:
                raise ConnectionError(f"the caller read nothing while {self.hub._max_outbox} messages waited")
            frame = up_type()
            replies = self._replies
            if len(replies) > MAX_REPLIES_PER_FRAME:
                taken, self._replies = replies[:MAX_REPLIES_PER_FRAME], replies[MAX_REPLIES_PER_FRAME:]
                self._fill(frame, taken)
            else:
                self._replies = []
                self._fill(frame, replies)
                # Ends only once every reply before them is in this frame or an earlier one.
                frame.ends.extend(self._ends)
                self._ends = []
            now = frame.sent_unix_ns = time.time_ns()
            if self._origin_ns and (latency := self.hub.latency) is not None:
                latency.record(self._origin_ns, now)
            if not self._replies:
                # Replies left for the next frame (a split backlog) keep the origin: it is theirs too.
                self._origin_ns = 0
            await self.context.write(frame)

    def _fill(self, frame: Any, replies: list[tuple[int, Any]]) -> None:
        """Replies into a frame: rows as columns where the caller reads them, the rest as
        messages. A frame's rows are read before its replies, so once a call has a message in
        the frame its later rows go as messages too: a call's replies stay in order."""
        rows = self.hub.kind.rows
        add = frame.replies.add
        if rows is None:
            for sid, response in replies:
                add(stream_id=sid, response=response)
            return
        row_ids: list[int] = []
        row_items: list[Any] = []
        as_messages: set[int] = set()
        row_type = rows.row_type
        for sid, response in replies:
            if type(response) is row_type:
                if self.accepts_rows and sid not in as_messages:
                    row_ids.append(sid)
                    row_items.append(response)
                    continue
                response = rows.to_message(response)
            as_messages.add(sid)
            add(stream_id=sid, response=response)
        if row_ids:
            rows.pack(frame, row_ids, row_items)
