"""Small network helpers."""

from __future__ import annotations

import asyncio
import random
import socket

# Below Linux's default ephemeral range (32768-60999): the kernel never gives these out as the
# source port of a connection or for a bind to port 0, so a port picked here for a process that
# binds it only much later (a vLLM engine, after loading its model) stays free meanwhile, where a
# port from `free_port` can be taken by any connection opened in between.
_UNASSIGNED = (20000, 32767)
_TRIES = 64


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on `host` (the caller binds it soon after; races are unlikely on loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_for_later(host: str = "127.0.0.1") -> int:
    """A free port outside the ephemeral range, for a bind that comes long after the choice."""
    rng = random.SystemRandom()
    for _ in range(_TRIES):
        port = rng.randint(*_UNASSIGNED)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    return free_port(host)


async def accepts_connections(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether something accepts a TCP connection on host:port now (within `timeout_s`)."""
    try:
        _reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (TimeoutError, OSError):
        return False
    writer.close()
    return True
