"""BodyWriter against a real uvicorn server on loopback (DirectWriteProtocol), on asyncio's loop
and on uvloop (the gateway's): direct writes and ASGI sends interleave into one valid chunked
body; the writer declines whenever writing would break order or flow control."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import httpx
import pytest
import uvicorn
import uvloop

from services.frontend.direct_write import BodyWriter, DirectWriteProtocol, body_writer

App = Callable[[BodyWriter, Callable[[dict], Awaitable[None]]], Awaitable[None]]
# Each test runs its scenario on both event loops.
LOOPS = pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
Run = Callable[[Coroutine[Any, Any, None]], None]


@contextlib.asynccontextmanager
async def serving(handle: App, protocol: type[DirectWriteProtocol] = DirectWriteProtocol) -> AsyncIterator[int]:
    async def app(scope, receive, send) -> None:  # noqa: ANN001 - an ASGI app
        writer = body_writer(scope)
        assert writer is not None
        await handle(writer, send)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    config = uvicorn.Config(app, http=protocol, lifespan="off", log_config=None, log_level="warning")
    config.load()
    # Server.serve's own start-up and shutdown, without its main loop between them (which looks
    # for a stop request every 0.1 s): the server is up once `startup` returns.
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    await server.startup(sockets=[sock])
    try:
        yield sock.getsockname()[1]
    finally:
        await asyncio.wait_for(server.shutdown(sockets=[sock]), 10)


START = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}


@LOOPS
def test_direct_writes_and_asgi_sends_make_one_body_in_order(run: Run) -> None:
    run(direct_writes_and_asgi_sends())


async def direct_writes_and_asgi_sends() -> None:
    declined_before_start: list[bool] = []
    declined_after_end: list[bool] = []
    writers: list[BodyWriter] = []

    async def handle(writer: BodyWriter, send: Callable[[dict], Awaitable[None]]) -> None:
        writers.append(writer)
        declined_before_start.append(writer.write(b"too early"))
        await send(START)
        assert writer.write(b"one ")
        await send({"type": "http.response.body", "body": b"two ", "more_body": True})
        assert writer.write(b"three \xe2\x82\xac")
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        declined_after_end.append(writer.write(b"too late"))

    async with serving(handle) as port, httpx.AsyncClient() as client:
        first = await client.get(f"http://127.0.0.1:{port}/")
        second = await client.get(f"http://127.0.0.1:{port}/")  # the same kept-alive connection
    assert first.status_code == 200 and first.headers["transfer-encoding"] == "chunked"
    assert first.content == b"one two three \xe2\x82\xac" == second.content
    assert declined_before_start == [False, False] and declined_after_end == [False, False]
    assert writers[0] is not writers[1]  # one writer per request, on one kept-alive connection
    assert first.extensions["network_stream"] is second.extensions["network_stream"]


@LOOPS
def test_a_client_that_does_not_read_is_declined_at_the_high_water_mark(run: Run) -> None:
    run(a_client_that_does_not_read())


async def a_client_that_does_not_read() -> None:
    written = asyncio.get_running_loop().create_future()

    async def handle(writer: BodyWriter, send: Callable[[dict], Awaitable[None]]) -> None:
        await send(START)
        chunk, total = b"x" * 4096, 0
        # The kernel's socket buffers take some first; then the transport's buffer fills.
        while total < 64 * 1024 * 1024 and writer.write(chunk):
            total += len(chunk)
            await asyncio.sleep(0)
        written.set_result(total)
        await send({"type": "http.response.body", "body": b"end", "more_body": False})

    async with serving(handle) as port:
        reader, conn = await asyncio.open_connection("127.0.0.1", port)
        conn.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        total = await asyncio.wait_for(written, 30)  # nothing read meanwhile
        body = b""
        while not body.endswith(b"0\r\n\r\n"):
            body += await asyncio.wait_for(reader.read(1 << 20), 30)
        conn.close()
    assert 0 < total < 64 * 1024 * 1024  # declined once the transport's buffer passed the mark
    assert body.count(b"1000\r\n" + b"x" * 4096 + b"\r\n") == total // 4096
    assert body.endswith(b"3\r\nend\r\n0\r\n\r\n")


@LOOPS
def test_a_client_that_left_is_declined(run: Run) -> None:
    run(a_client_that_left())


async def a_client_that_left() -> None:
    after_leaving: list[bool] = []
    lost = asyncio.Event()
    answered = asyncio.Event()

    class Watched(DirectWriteProtocol):
        def connection_lost(self, exc: Exception | None) -> None:
            super().connection_lost(exc)
            lost.set()

    async def handle(writer: BodyWriter, send: Callable[[dict], Awaitable[None]]) -> None:
        await send(START)
        assert writer.write(b"hello")
        await lost.wait()  # the server has seen the client leave
        after_leaving.append(writer.write(b"more"))
        answered.set()

    async with serving(handle, Watched) as port:
        reader, conn = await asyncio.open_connection("127.0.0.1", port)
        conn.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"5\r\nhello\r\n"), 10)
        conn.close()
        await asyncio.wait_for(answered.wait(), 10)
    assert b"transfer-encoding: chunked" in head
    assert after_leaving == [False]
