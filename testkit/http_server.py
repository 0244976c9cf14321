"""An aiohttp app served on loopback until SIGTERM or SIGINT: the test kit's small HTTP servers
(recorder.py, scripted_model.py) run as child processes a test starts and stops with a signal."""

from __future__ import annotations

import asyncio
import signal

from aiohttp import web

# Agent requests carry tens of thousands of tokens of tools and history.
MAX_BODY_BYTES = 256 << 20


def application() -> web.Application:
    return web.Application(client_max_size=MAX_BODY_BYTES)


async def serve_until_signal(app: web.Application, port: int, ready: str) -> None:
    """Serves `app` on 127.0.0.1:`port`, prints `READY <ready>` once listening, and returns
    after the app is cleaned up, once a SIGTERM or SIGINT came."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print(f"READY {ready}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
