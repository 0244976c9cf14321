"""The calling end of multiplexed sessions (session_kind.py): one stream per peer, many calls.

`SessionPool.get(kind, address)` gives the session to a peer, opening one when there is none or
the last one broke. `Session.open(request, timeout_s, metadata)` starts a call and returns its
`SessionStream`: an async iterator of the call's responses that raises `CallError` when the call
ends otherwise than OK. `Session.call` does the same for a call with one response.

One writer task per session sends what callers opened and cancelled since its last frame, as one
frame; one reader task hands each reply to its call's buffer. The reader never waits for a
consumer, so a slow consumer (an HTTP client that reads slowly) never holds up the other calls
of its session. Bounds, and what happens at them:
- a call's unread responses: `max_buffered_per_call`; past it that call alone fails with
  OUTCOME_READ_TOO_SLOWLY and is cancelled at the peer;
- a session's unread responses: `max_buffered_per_session`; past it the call with the most
  unread responses fails the same way.
A call has one deadline: sent to the peer (which ends it OUTCOME_DEADLINE) and kept here too, so
a peer that never answers still cannot hold a caller past it. A session that breaks (the peer
died, the connection dropped, the peer drained and closed it) fails every call open on it with
OUTCOME_PEER_GONE; the next `get` opens a new session.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc

from services.mesh.channels import ChannelPool
from services.mesh.session_carrier import Carrier, CarrierDialer, GrpcCarrier
from services.mesh.hop_latency import FrameClock
from gen.kvmesh.v1 import common_pb2
from services.mesh.session_kind import OK, CallError, SessionKind
from services.mesh.tasks import cancel_and_wait

log = logging.getLogger(__name__)

PEER_GONE = common_pb2.OUTCOME_PEER_GONE
PEER_FAILED = common_pb2.OUTCOME_PEER_FAILED

# Requests per frame down: a frame of long prompts stays far below the gRPC message limit.
MAX_DOWN_FRAME_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class SessionLimits:
    max_buffered_per_call: int = 8192
    max_buffered_per_session: int = 262144


class SessionStream:
    """One call's responses, in order; `CallError` at the end of a call that failed."""

    __slots__ = ("stream_id", "_session", "_items", "_frames", "_waiter", "_error", "_ended", "_timer", "sink",
                 "frame_ns")

    def __init__(self, stream_id: int, session: Session) -> None:
        self.stream_id = stream_id
        self._session = session
        self._items: deque[Any] = deque()
        # The write time of the frame each buffered response came in (hop_latency.py).
        self._frames: deque[int] = deque()
        self._waiter: asyncio.Future[None] | None = None
        # What the consumer raises at the end: the call's CallError, or what its sink raised.
        self._error: Exception | None = None
        self._ended = False
        self._timer: asyncio.TimerHandle | None = None
        # Takes the call's rows where its frame is read, instead of waking the consumer for each
        # (set by the consumer; see `_push_row`). Returns whether it took the row.
        self.sink: Callable[[Any], bool] | None = None
        # The write time of the frame that brought the response read last: where the next hop's
        # latency counts from (hop_latency.py).
        self.frame_ns = 0

    def __aiter__(self) -> SessionStream:
        return self

    async def __anext__(self) -> Any:
        items = self._items
        while not items:
            if self._ended:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        self._session.buffered -= 1
        self.frame_ns = self._frames.popleft()
        return items.popleft()

    def take_ready(self, row_type: type) -> list[Any]:
        """The unread responses at the head of the call's buffer that are rows of `row_type`,
        taken at once (a consumer that is behind sends them together)."""
        items, frames = self._items, self._frames
        taken = []
        while items and type(items[0]) is row_type:
            taken.append(items.popleft())
            frames.popleft()
        self._session.buffered -= len(taken)
        return taken

    async def result(self) -> Any:
        """The response of a call that has one."""
        async for response in self:
            return response
        raise CallError(PEER_FAILED, f"{self._session.kind.name}: the call ended without a response")

    def cancel(self) -> None:
        """Gives the call up: the peer stops it; a stream that already ended is left as it is."""
        if not self._ended:
            self._finish(CallError(common_pb2.OUTCOME_CANCELLED, "the call was cancelled"))
            self._session._cancel(self.stream_id)

    # -- from the session --------------------------------------------------------------------

    def _push_row(self, row: Any) -> None:
        """A row goes to the sink while the consumer waits with nothing unread (so it stays in
        order after every reply before it), else, or when the sink declines it, into the buffer
        like any reply."""
        sink = self.sink
        if sink is not None and not self._items and not self._ended:
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                # The sink reads the row as the consumer would have: with its frame's time.
                self.frame_ns = self._session.clock.reading_ns
                try:
                    if sink(row):
                        return
                except Exception as exc:  # noqa: BLE001 - the consumer's to raise, not the session reader's
                    # Raised where the consumer reads, as if it had handled the row itself; the
                    # session's other calls go on.
                    self.sink = None
                    self._session._fail(self, exc)
                    return
        self._push(row)

    def _push(self, response: Any) -> None:
        if self._ended:
            return
        self._frames.append(self._session.clock.reading_ns)
        self._items.append(response)
        session = self._session
        session.buffered += 1
        if len(self._items) > session.limits.max_buffered_per_call:
            session._overflow(self)
        elif session.buffered > session.limits.max_buffered_per_session:
            session._overflow(max(session.streams.values(), key=lambda s: len(s._items)))
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _finish(self, error: Exception | None) -> None:
        """Ends the call; what the consumer has not read yet still comes before the error."""
        if self._ended:
            return
        self._ended = True
        self._error = error
        if self._timer is not None:
            self._timer.cancel()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _drop_buffered(self) -> int:
        dropped = len(self._items)
        self._items.clear()
        self._frames.clear()
        return dropped


class Session:
    """One stream to one peer carrying many calls."""

    def __init__(self, kind: SessionKind, channel: grpc.aio.Channel, address: str, limits: SessionLimits,
                 clock: FrameClock | None = None, dialer: CarrierDialer | None = None) -> None:
        """`dialer`: carries the session over TCP where the peer offers it (session_carrier.py);
        None, or a peer that offers none: over the service's gRPC stream."""
        self._calls(kind, address, limits, clock)
        self._opened: list[tuple[int, int, Iterable[tuple[str, str]] | None, Any]] = []
        self._cancelled: list[int] = []
        self._wake = asyncio.Event()
        self._channel = channel
        self._dialer = dialer
        self._carrier: Carrier | None = None
        # The session's tasks serve every request on it: they run outside the context of the
        # request that happened to open it (its request id would stand on the session's log lines).
        own = contextvars.Context()
        self._connected = asyncio.create_task(self._connect(), name=f"{kind.name} session carrier {address}",
                                              context=own)
        self._reader = asyncio.create_task(self._read(), name=f"{kind.name} session reader {address}", context=own)
        self._writer = asyncio.create_task(self._write(), name=f"{kind.name} session writer {address}", context=own)

    def _calls(self, kind: SessionKind, address: str, limits: SessionLimits, clock: FrameClock | None) -> None:
        """The bookkeeping of the session's calls, whatever carries them."""
        self.kind = kind
        self.address = address
        self.limits = limits
        # Set to each frame's write time while its replies are handed out.
        self.clock = clock or FrameClock()
        self.streams: dict[int, SessionStream] = {}
        self.buffered = 0
        self.closed = False
        self.frames_received = 0
        self._ids = itertools.count(1)

    def open(self, request: Any, timeout_s: float | None = None,
             metadata: Iterable[tuple[str, str]] | None = None) -> SessionStream:
        """Starts a call; a session already broken gives a stream that fails with OUTCOME_PEER_GONE."""
        sid = next(self._ids)
        stream = SessionStream(sid, self)
        if self.closed:
            stream._finish(CallError(PEER_GONE, f"the session to {self.address} is closed"))
            return stream
        self.streams[sid] = stream
        timeout_ms = 0
        if timeout_s is not None:
            timeout_ms = max(1, int(timeout_s * 1000))
            stream._timer = asyncio.get_running_loop().call_later(timeout_s, self._expire, stream, timeout_s)
        self._send_open(stream, timeout_ms, metadata, request)
        return stream

    def _send_open(self, stream: SessionStream, timeout_ms: int, metadata: Iterable[tuple[str, str]] | None,
                   request: Any) -> None:
        """The call goes out with the next frame."""
        self._opened.append((stream.stream_id, timeout_ms, metadata, request))
        self._wake.set()

    async def call(self, request: Any, timeout_s: float | None = None,
                   metadata: Iterable[tuple[str, str]] | None = None) -> Any:
        stream = self.open(request, timeout_s, metadata)
        try:
            return await stream.result()
        finally:
            stream.cancel()

    async def close(self) -> None:
        self._break(f"the session to {self.address} was closed")
        await cancel_and_wait(self._reader, self._writer, self._connected)

    @property
    def carrier(self) -> str:
        """What the session travels on: "tcp" or "grpc" ("" while it connects)."""
        return self._carrier.name if self._carrier is not None else ""

    async def _connect(self) -> Carrier:
        """The session's connection: TCP where the dialer finds the peer offers it, else gRPC.
        Calls opened meanwhile wait in the first frame."""
        carrier: Carrier | None = None
        if self._dialer is not None:
            carrier = await self._dialer.open(self.address, self.kind.method, self.kind.up)
        if carrier is None:
            carrier = GrpcCarrier(self._channel, self.kind.method, self.kind.down, self.kind.up)
        if self.closed:
            # Closed while connecting (a cancellation the connect's own wait swallowed on 3.11).
            carrier.cancel()
            raise ConnectionError(f"the session to {self.address} was closed while connecting")
        self._carrier = carrier
        log.info("%s session to %s over %s", self.kind.name, self.address, carrier.name)
        return carrier

    # -- calls ending ------------------------------------------------------------------------

    def _cancel(self, sid: int) -> None:
        if self.streams.pop(sid, None) is not None and not self.closed:
            self._cancelled.append(sid)
            self._wake.set()

    def _fail(self, stream: SessionStream, error: Exception) -> None:
        """Ends a call here and at the peer, dropping what it had not read: nobody will."""
        self.buffered -= stream._drop_buffered()
        stream._finish(error)
        self._cancel(stream.stream_id)

    def _expire(self, stream: SessionStream, timeout_s: float) -> None:
        if not stream._ended:
            self._fail(stream, CallError(common_pb2.OUTCOME_DEADLINE,
                                         f"no answer from {self.address} within the call's {timeout_s:.1f}s deadline"))

    def _overflow(self, stream: SessionStream) -> None:
        unread = len(stream._items)
        log.warning("%s session to %s: call %d failed, %d responses unread", self.kind.name, self.address,
                    stream.stream_id, unread)
        self._fail(stream, CallError(common_pb2.OUTCOME_READ_TOO_SLOWLY,
                                     f"the response is read too slowly ({unread} messages waited unread)"))

    def _break(self, message: str) -> None:
        """The session is over: every call still open fails with OUTCOME_PEER_GONE (the caller
        may try another peer)."""
        if self.closed:
            return
        self.closed = True
        streams, self.streams = self.streams, {}
        for stream in streams.values():
            stream._finish(CallError(PEER_GONE, message))
        self._stop_carrying()

    def _stop_carrying(self) -> None:
        """What carries the calls stops (the session broke or closed)."""
        if self._carrier is not None:
            self._carrier.cancel()
        else:
            self._connected.cancel()
        self._wake.set()

    # -- the stream ------------------------------------------------------------------------------

    async def _read(self) -> None:
        clock = self.clock
        try:
            carrier = await self._connected
            while True:
                frame = await carrier.read()
                if frame is None:
                    self._break(f"{self.address} closed the {self.kind.name} session")
                    return
                self.frames_received += 1
                clock.reading_ns = frame.sent_unix_ns
                try:
                    if self.kind.rows is not None:
                        await self._hand_out_rows(frame)
                    self._hand_out(frame)
                finally:
                    clock.reading_ns = 0  # replies made from here on are not made of this frame
        except grpc.aio.AioRpcError as exc:
            self._break(f"the {self.kind.name} session to {self.address} broke: {exc.code().name} {exc.details()}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the TCP carrier's connection, a frame that does not parse
            # Whatever ends the reader ends the session: its calls must fail now, not at their deadline.
            self._break(f"the {self.kind.name} session to {self.address} broke: "
                        f"{type(exc).__name__} {exc}".rstrip())

    async def _hand_out_rows(self, frame: Any) -> None:
        """A frame's rows to their calls, before its replies and ends (session_kind.py), letting
        the loop run after every `per_slice` rows where the kind says so."""
        rows = self.kind.rows
        assert rows is not None
        streams, clock, sent_ns = self.streams, self.clock, frame.sent_unix_ns
        # Counts down to the next turn of the loop; from 0 it only goes negative: never.
        countdown = rows.per_slice
        for sid, row in rows.unpack(frame):
            stream = streams.get(sid)
            if stream is not None:
                stream._push_row(row)
            countdown -= 1
            if not countdown:
                countdown = rows.per_slice
                clock.reading_ns = 0  # the pool's clock: other sessions' frames are read meanwhile
                await asyncio.sleep(0)
                clock.reading_ns = sent_ns

    def _hand_out(self, frame: Any) -> None:
        """A frame's replies and ends to their calls, in that order, after its rows."""
        streams = self.streams
        for reply in frame.replies:
            stream = streams.get(reply.stream_id)
            if stream is not None:
                stream._push(reply.response)
        for end in frame.ends:
            stream = streams.pop(end.stream_id, None)
            if stream is not None:
                stream._finish(None if end.outcome == OK else CallError.from_end(end))

    async def _write(self) -> None:
        call_type, down_type = self.kind.call, self.kind.down
        # The first frame says this end reads rows (session_kind.ReplyRows), where the kind has them.
        announce = self.kind.rows is not None
        try:
            carrier = await self._connected
            while not self.closed:
                if not self._opened and not self._cancelled:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                frame = down_type()
                size = 0
                opened = self._opened
                taken = 0
                for sid, timeout_ms, metadata, request in opened:
                    if sid not in self.streams:
                        taken += 1  # cancelled or expired before it left: never sent
                        continue
                    call = call_type(stream_id=sid, timeout_ms=timeout_ms, request=request)
                    if metadata:
                        for key, value in metadata:
                            call.metadata[key] = value
                    size += call.ByteSize()
                    if size > MAX_DOWN_FRAME_BYTES and taken:
                        break
                    frame.calls.append(call)
                    taken += 1
                self._opened = opened[taken:]
                frame.cancel.extend(self._cancelled)
                self._cancelled = []
                if announce:
                    frame.accepts_rows = True
                    announce = False
                await carrier.write(frame)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - as the reader: the session ends with its writer
            self._break(f"the {self.kind.name} session to {self.address} broke: {type(exc).__name__} {exc}".rstrip())


class SessionPool:
    """One session per (kind, peer address), reopened after a break, closed with the owner."""

    def __init__(self, channels: ChannelPool, limits: SessionLimits | None = None,
                 dialer: CarrierDialer | None = None) -> None:
        """`dialer`: sessions over TCP where peers offer it (session_carrier.py); None: over gRPC."""
        self._channels = channels
        self._dialer = dialer
        self._limits = limits or SessionLimits()
        # Shared by the pool's sessions: the upstream frame this process is reading right now.
        self.clock = FrameClock()
        self._sessions: dict[tuple[str, str], Session] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def get(self, kind: SessionKind, address: str) -> Session:
        key = (kind.method, address)
        session = self._sessions.get(key)
        if session is None or session.closed:
            if session is not None:
                self._retire(session)
            session = self._sessions[key] = Session(kind, self._channels.get(address), address, self._limits,
                                                    self.clock, self._dialer)
        return session

    def _retire(self, session: Session) -> None:
        # A broken session's tasks end by themselves; closing makes sure of it.
        task = asyncio.get_running_loop().create_task(session.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        sessions, self._sessions = list(self._sessions.values()), {}
        await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)
        await asyncio.gather(*self._closing, return_exceptions=True)
