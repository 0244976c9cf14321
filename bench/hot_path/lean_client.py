"""A lean load generator for thousands of streamed completions: raw HTTP/1.1 over asyncio
streams, no JSON per event.

On a 2-core machine the load generator competes with the mesh it measures: aiohttp plus a JSON
decode per event cost about 50 µs per token, a third of the machine at 512 streams. Here each
socket read is timestamped once and its events are counted by their `data: {` line start (the
SSE framing the gateway writes); only the stream's last events are decoded, for the usage. An
event's arrival is its read's time, which is what a client sees.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

# An event's start: a raw newline never occurs inside its JSON (the encoder escapes it), so the
# prefix cannot match text the model wrote; the line before an event is a chunk size or an event.
EVENT = b"\ndata: {"
DONE = b"data: [DONE]"
# Bytes kept from a stream's end: its usage event and [DONE].
TAIL_BYTES = 4096


@dataclass
class LeanStream:
    started: float
    # One arrival per event that carries tokens (the usage event left out).
    arrivals: list[float]
    completion_tokens: int


def completion(model: str, prompt: str, max_tokens: int) -> tuple[str, dict]:
    """A streamed completion of exactly `max_tokens` tokens: (path, body) for `lean_stream`."""
    return "/v1/completions", {"prompt": prompt, **_streamed(model, max_tokens)}


def chat(model: str, prompt: str, max_tokens: int, **extra: object) -> tuple[str, dict]:
    """A streamed chat completion of exactly `max_tokens` tokens per choice, with `extra` fields."""
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}],
                                    **_streamed(model, max_tokens), **extra}


def _streamed(model: str, max_tokens: int) -> dict:
    """What every benchmark stream asks: exactly `max_tokens` tokens, streamed, with the usage."""
    return {"model": model, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}


async def lean_stream(base: str, request: tuple[str, dict], timeout_s: float) -> LeanStream:
    """One streamed request (`completion` or `chat`) over its own connection."""
    url = urlsplit(base)
    path, fields = request
    body = json.dumps(fields).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    started = time.perf_counter()
    # One deadline for the whole stream (a timer per read would cost a task per event).
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        try:
            writer.write(head + body)
            answer = await reader.readuntil(b"\r\n\r\n")
            if not answer.startswith(b"HTTP/1.1 200"):
                rest = await reader.read(2000)
                raise RuntimeError(f"{answer.split(b' ', 2)[1].decode()}: {(answer + rest)[-300:]!r}")
            return await _events(reader, started)
        finally:
            writer.close()


async def _events(reader: asyncio.StreamReader, started: float) -> LeanStream:
    arrivals: list[float] = []
    # The end of the previous read (an event's start may straddle two reads); a newline at first,
    # as if the headers' end were the line before the first event.
    carried = b"\n"
    tail = b""
    while True:
        data = await reader.read(65536)
        if not data:
            raise RuntimeError("the stream ended before [DONE]")
        now = time.perf_counter()
        window = carried + data
        # `carried` is shorter than the prefix, so no event is counted twice.
        arrivals.extend([now] * window.count(EVENT))
        carried = window[-(len(EVENT) - 1):]
        tail = (tail + data)[-TAIL_BYTES:]
        if DONE in tail:
            break
    usage_at = tail.rfind(EVENT, 0, tail.rfind(DONE))
    last = json.loads(tail[usage_at + len(EVENT) - 1:].split(b"\n", 1)[0])
    if "usage" not in last:
        raise RuntimeError(f"the stream ended without its usage: {json.dumps(last)[:300]}")
    return LeanStream(started, arrivals[:-1], last["usage"]["completion_tokens"])


# A stream of several choices gets one event per choice per step, not always in one read: its
# arrivals closer than this are one step's.
SAME_STEP_S = 0.001


def arrival_gaps(arrivals: list[float], since: float, choices: int = 1) -> list[float]:
    """Gaps in ms between distinct arrivals (events read together arrive together) from `since`."""
    times = sorted({t for t in arrivals if t >= since})
    if choices > 1:
        steps = times[:1]
        for t in times[1:]:
            if t - steps[-1] >= SAME_STEP_S:
                steps.append(t)
        times = steps
    return [(b - a) * 1000 for a, b in zip(times, times[1:])]
