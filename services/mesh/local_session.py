"""A session to a service in this process: the calls of a session (session_client.py) without
its stream.

A gateway that hosts its own processor (`--embed-processor`) opens its calls to that processor
here: each call runs the processor's session handler (the `SessionHub`'s, the one its remote
callers reach through frames) as a task of this process, and what it yields is pushed straight
into the call's `SessionStream`. Nothing is serialized, framed, written or read, so the hop costs
a task and its hand-offs, not the two gRPC stream messages each way and the wake-ups of two
processes that a remote call costs.

Every rule of a session holds: replies in order before the end; one deadline per call (the
caller's timer, which cancels the handler); a consumer that reads too slowly fails its call alone
(the same buffer bounds); a call cancelled by its caller cancels the handler; a draining hub
refuses new calls with OUTCOME_PEER_DRAINING; a handler's bug ends its call OUTCOME_PEER_FAILED
and no other. Rows (session_kind.ReplyRows) stay rows: the caller reads the same tuples a
remote caller gets unpacked from a frame.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from gen.kvmesh.v1 import common_pb2
from services.mesh.hop_latency import FrameClock
from services.mesh.session_client import Session, SessionLimits, SessionStream
from services.mesh.session_kind import CallError, CallInfo
from services.mesh.session_server import SessionHub

log = logging.getLogger(__name__)


class LocalSession(Session):
    """`Session` for a hub served by this process; `address` is where the hub's service also
    answers over gRPC (its registered address: unary calls such as CountTokens go there)."""

    def __init__(self, hub: SessionHub, address: str, limits: SessionLimits | None = None,
                 clock: FrameClock | None = None) -> None:
        """`clock`: the caller's session pool's (SessionPool.clock). A reply made while a frame
        from further up is handed out (a processor's row made of a decode worker's frame) carries
        that frame's write time, so the caller's hop measures from there (hop_latency.py)."""
        # Session's own constructor connects to a peer: only its calls' bookkeeping is set here.
        self._calls(hub.kind, address, limits or SessionLimits(), clock)
        self._hub = hub
        self._tasks: dict[int, asyncio.Task[None]] = {}
        rows = hub.kind.rows
        self._row_type = rows.row_type if rows is not None else None

    def _send_open(self, stream: SessionStream, timeout_ms: int, metadata: Iterable[tuple[str, str]] | None,
                   request: Any) -> None:
        """Runs the call now (the caller's timer, set by `open`, is its deadline)."""
        if self._hub.draining:
            self.streams.pop(stream.stream_id, None)
            stream._finish(CallError(common_pb2.OUTCOME_PEER_DRAINING, "the server is draining"))
            return
        sid = stream.stream_id
        info = CallInfo(dict(metadata or ()), lambda response: self._reply_open(stream, response))
        task = asyncio.get_running_loop().create_task(self._serve(stream, request, info))
        self._tasks[sid] = task
        task.add_done_callback(lambda _: self._tasks.pop(sid, None))

    async def _serve(self, stream: SessionStream, request: Any, info: CallInfo) -> None:
        error: Exception | None = None
        try:
            async for response in self._hub.handler(request, info):
                self._deliver(stream, response)
        except CallError as exc:
            error = exc
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                return  # cancelled by its caller, its deadline or the session's close: no end from here
            # A cancellation the handler let out of its own work (not this call's): the call fails.
            error = CallError(common_pb2.OUTCOME_PEER_FAILED, "the handler was cancelled")
        except Exception as exc:  # noqa: BLE001 - a bug in one call must not end the others
            log.exception("%s local session: call %d failed", self.kind.name, stream.stream_id)
            error = CallError(common_pb2.OUTCOME_PEER_FAILED, f"{type(exc).__name__}: {exc}")
        if self.streams.pop(stream.stream_id, None) is not None:
            stream._finish(error)

    def _deliver(self, stream: SessionStream, response: Any) -> None:
        if type(response) is self._row_type:
            stream._push_row(response)
        else:
            stream._push(response)

    def _reply_open(self, stream: SessionStream, response: Any) -> None:
        """A reply from outside the call's task (CallInfo.reply): dropped once the call ended."""
        if stream.stream_id in self.streams:
            self._deliver(stream, response)

    def _cancel(self, sid: int) -> None:
        self.streams.pop(sid, None)
        task = self._tasks.pop(sid, None)
        if task is not None:
            task.cancel()

    def _stop_carrying(self) -> None:
        for task in self._tasks.values():
            task.cancel()

    async def close(self) -> None:
        self._break(f"the session to {self.address} was closed")
        tasks = list(self._tasks.values())
        await asyncio.gather(*tasks, return_exceptions=True)
