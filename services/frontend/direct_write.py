"""A streamed answer's text events written to the client's connection where the row arrives.

Sent the ASGI way, each event of a stream wakes the request's task and passes its async
generators, Starlette's body loop and uvicorn's `send` before its socket write: per stream, per
engine step. Most events are one choice's next text, so while the request's task waits for its
next response, the session reader that holds the text row writes the event itself
(`SessionStream.sink`, installed by `Answer.sse`): one template concatenation and one socket write.

`DirectWriteProtocol` is uvicorn's httptools protocol, plus a `BodyWriter` in each request's scope
(`body_writer(scope)`). A writer writes exactly what uvicorn's `send` would have written at that
point (one chunk of the chunked body), and only while that keeps order and flow control: after
the response started and before it completed, with the client still there, and while the
connection's write buffer is under uvicorn's high-water mark. Otherwise it declines: the row goes
to the request's task, whose `send` waits for the client, so a slow reader gets the rows it fell
behind on coalesced into larger writes, and a call that falls too far behind fails as "read too
slowly" (session_client.SessionLimits) without holding up anyone else's stream.

This reads uvicorn's `RequestResponseCycle` fields: uvicorn is pinned (requirements.txt) and
tests/unit/test_direct_write.py holds a real server to it.
"""

from __future__ import annotations

from typing import Any

from starlette.types import Scope
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

EXTENSION = "kvmesh.body_writer"


class BodyWriter:
    """Writes body chunks of one response straight to its connection, when that is safe."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = cycle

    def write(self, data: bytes) -> bool:
        """Writes `data` as the response's next body chunk; False (nothing written) when it
        must take the ASGI path instead."""
        cycle = self._cycle
        if (not cycle.response_started or cycle.response_complete or cycle.disconnected
                or cycle.chunked_encoding is not True or cycle.flow.write_paused or not data):
            return False
        transport = cycle.transport
        if transport.is_closing():
            return False
        transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return True


class DirectWriteProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, giving each request a BodyWriter (scope extension)."""

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycle: Any = self.cycle
        # No new cycle for a connection upgrade: the scope is then not a plain request's.
        if cycle is not None and cycle.scope is self.scope:
            self.scope.setdefault("extensions", {})[EXTENSION] = BodyWriter(cycle)


def body_writer(scope: Scope) -> BodyWriter | None:
    """The request's writer, or None when the server gives none (another ASGI server)."""
    extensions = scope.get("extensions")
    return extensions.get(EXTENSION) if extensions else None
