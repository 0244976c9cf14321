"""A real gRPC server in the test's own process, for tests of the session protocol's two ends."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc


@asynccontextmanager
async def serving(add_servicer: Callable[[Any, grpc.aio.Server], None], servicer: Any) -> AsyncIterator[str]:
    """Serves `servicer` on a free loopback port for the block; yields its address."""
    server = grpc.aio.server()
    add_servicer(servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        yield address
    finally:
        await server.stop(None)


async def read_all(stream: AsyncIterator[Any]) -> list[Any]:
    return [reply async for reply in stream]
