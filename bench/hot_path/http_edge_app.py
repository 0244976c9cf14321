"""The HTTP edge alone: one server, N streams, one SSE event per stream every 20 ms from one
ticker task (as a gateway writes one row per stream per processor frame). Served four ways by
http_edge.py; the server under test runs this module:

- `uvicorn-asgi`: uvicorn (httptools, uvloop), each stream's task woken per event and sending it
  through ASGI (the gateway before direct writes);
- `uvicorn-direct`: uvicorn with kvmesh's DirectWriteProtocol, the ticker writing each event to
  its connection (services/frontend/direct_write.py: the gateway now);
- `granian-asgi` and `granian-rsgi`: granian (Rust HTTP, uvloop), each stream's task woken per
  event and sending it through ASGI, or through RSGI's `send_bytes`.

`python -m bench.hot_path.http_edge_app MODE PORT` runs a uvicorn mode; granian runs `asgi` or
`rsgi` from here as its target. Events per stream: KVMESH_EDGE_EVENTS (default 200).
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

STEP_S = 0.020
EVENTS = int(os.environ.get("KVMESH_EDGE_EVENTS", "200"))
# About the size of a completion's text event.
EVENT = (b'data: {"id":"cmpl-0123456789abcdef0123456789abcdef","object":"text_completion","created":1764000000,'
         b'"model":"kvmesh-demo","choices":[{"index":0,"text":" word","finish_reason":null,"logprobs":null}]}\n\n')
END = b'data: {"choices":[],"usage":{"completion_tokens":%d}}\n\ndata: [DONE]\n\n' % EVENTS

Deliver = Callable[[bytes], None]


class Ticker:
    """Every STEP_S, one event to every open stream; a stream ends after EVENTS of them."""

    def __init__(self) -> None:
        self._streams: list[tuple[Deliver, list[int], asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None

    def add(self, deliver: Deliver) -> asyncio.Future[None]:
        """`deliver` gets the stream's events; the future is done after its last."""
        loop = asyncio.get_running_loop()
        if self._task is None:
            self._task = loop.create_task(self._run())
        done: asyncio.Future[None] = loop.create_future()
        self._streams.append((deliver, [0], done))
        return done

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        at = loop.time()
        while True:
            at += STEP_S
            await asyncio.sleep(max(0.0, at - loop.time()))
            open_streams = []
            for stream in self._streams:
                deliver, sent, done = stream
                deliver(EVENT)
                sent[0] += 1
                if sent[0] < EVENTS:
                    open_streams.append(stream)
                else:
                    done.set_result(None)
            self._streams = open_streams


TICKER = Ticker()


async def woken(send: Callable[[bytes], Awaitable[None]]) -> None:
    """A stream whose task is woken per event to send it (what is waiting, in one send)."""
    pending: list[bytes] = []
    waiter: list[asyncio.Future[None] | None] = [None]

    def deliver(data: bytes) -> None:
        pending.append(data)
        if (w := waiter[0]) is not None and not w.done():
            w.set_result(None)

    done = TICKER.add(deliver)
    loop = asyncio.get_running_loop()
    while not (done.done() and not pending):
        if not pending:
            waiter[0] = loop.create_future()
            await waiter[0]
            continue
        data = b"".join(pending)
        pending.clear()
        await send(data)


async def asgi(scope: dict, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    writer = None
    if os.environ.get("KVMESH_EDGE_MODE") == "uvicorn-direct":
        from services.frontend.direct_write import body_writer

        writer = body_writer(scope)
    if writer is not None:
        declined: list[bytes] = []  # from the first the writer declines (past the buffer's mark), in order, at the end

        def deliver(data: bytes) -> None:
            if declined or not writer.write(data):
                declined.append(data)

        await TICKER.add(deliver)
        if declined:
            await send({"type": "http.response.body", "body": b"".join(declined), "more_body": True})
    else:
        await woken(lambda data: send({"type": "http.response.body", "body": data, "more_body": True}))
    await send({"type": "http.response.body", "body": END, "more_body": False})


class _Rsgi:
    async def __rsgi__(self, scope: Any, protocol: Any) -> None:
        transport = protocol.response_stream(200, [("content-type", "text/event-stream")])
        await woken(transport.send_bytes)
        await transport.send_bytes(END)


rsgi = _Rsgi()


def main() -> None:
    import uvicorn

    mode, port = sys.argv[1], int(sys.argv[2])
    os.environ["KVMESH_EDGE_MODE"] = mode
    http: Any = "httptools"
    if mode == "uvicorn-direct":
        from services.frontend.direct_write import DirectWriteProtocol

        http = DirectWriteProtocol
    uvicorn.run(asgi, host="127.0.0.1", port=port, http=http, loop="uvloop", log_level="warning", access_log=False,
                backlog=4096)


if __name__ == "__main__":
    main()
