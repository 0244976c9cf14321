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
connection's write buffer is under the transport's high-water mark (64 KiB on uvloop and asyncio;
past it uvicorn's `send` waits for the client). Otherwise it declines: the row goes
to the request's task, whose `send` waits for the client, so a slow reader gets the rows it fell
behind on coalesced into larger writes, and a call that falls too far behind fails as "read too
slowly" (session_client.SessionLimits) without holding up anyone else's stream.

Order is the caller's to keep: a writer may only be used while nothing of the response is on
its way through ASGI (no `send` in progress or about to run, no middleware holding or rewriting
the body). `Answer.sse` uses it only while its task waits for its next response with every event
before it sent, and the gateway's ASGI stack neither buffers nor transforms bodies.

This reads uvicorn's `RequestResponseCycle` fields: uvicorn is pinned (requirements.txt) and
tests/unit/test_direct_write.py holds a real server to it.
"""

from __future__ import annotations

import weakref
from typing import Any

from starlette.types import Scope
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

EXTENSION = "kvmesh.body_writer"


class BodyWriter:
    """Writes body chunks of one response straight to its connection, when that is safe."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: RequestResponseCycle) -> None:
        # Weak: the cycle holds the scope that holds this writer, and a request's objects should
        # go when it ends, not at the next full collection.
        self._cycle = weakref.ref(cycle)

    def write(self, data: bytes) -> bool:
        """Writes `data` as the response's next body chunk; False (nothing written) when it
        must take the ASGI path instead."""
        cycle = self._cycle()
        if (cycle is None or not cycle.response_started or cycle.response_complete or cycle.disconnected
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
        cycle = self.cycle
        # No new cycle for a connection upgrade: the scope is then not a plain request's.
        if cycle is not None and cycle.scope is self.scope:
            extensions: dict[str, Any] = self.scope.setdefault("extensions", {})  # type: ignore[assignment]
            extensions[EXTENSION] = {"writer": BodyWriter(cycle)}  # an ASGI extension is a dict


def body_writer(scope: Scope) -> BodyWriter | None:
    """The request's writer, or None when the server gives none (another ASGI server)."""
    extension = (scope.get("extensions") or {}).get(EXTENSION)
    return extension.get("writer") if extension else None
