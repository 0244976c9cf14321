"""The one SSE client of the tests and the benchmarks: a streamed OpenAI completion (or chat
completion) read to its end, and what its client saw (`Streamed`): the status and headers, the
text by chunk, the finish reason, the usage, when each chunk arrived (the time to the first one,
the gaps between them), whether it ended with `[DONE]`, an SSE error event, a connection that broke.

Two transports, one reading (`Streamed.feed`): `stream` (aiohttp, on an event loop: the
benchmarks' loads and asyncio tests) and `stream_sync` (httpx, blocking: tests that stream from
threads). Neither raises for what the server does: a refusal is a status and a body, an error
event is `error`, a broken connection or a client timeout is `broken`. Chunks are decoded with
msgspec (a few times cheaper than json): a load generator shares the machine with the mesh.

Not this client: bench/hot_path/lean_client.py, the benchmarks' lean load generator (raw
HTTP/1.1, no JSON per event), which stays apart as the measured minimum a client can cost.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
import msgspec

MODEL = "kvmesh-demo"
_decode = msgspec.json.Decoder().decode

# Called with the stream so far: once its headers are in (`on_open`), after each chunk that
# carries choices (`on_chunk`).
Hook = Callable[["Streamed"], None]


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt_tokens_details.cached_tokens; 0 where the usage has none


@dataclass
class Streamed:
    """One streamed request as its client saw it. Times are `time.perf_counter()` readings."""

    status: int = 0  # 0: no answer (the connection failed first)
    headers: dict[str, str] = field(default_factory=dict)  # names in lower case
    body: str = ""  # an answer other than 200: its body
    started: float = math.nan  # sent
    ended: float = math.nan  # the body read to its end, or given up
    arrivals: list[float] = field(default_factory=list)  # one per chunk that carries choices
    # One per chunk whose choices carry text: what TTFT and the gaps between tokens are read from
    # (a role-only first delta or a finish-only last chunk is no token).
    content_arrivals: list[float] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)  # the text of each choice of those chunks, in order
    finish: str | None = None  # the last finish reason a choice gave
    usage: Usage | None = None
    done: bool = False  # the last event was `[DONE]`
    error: str | None = None  # an SSE error event's message (the last one)
    broken: str | None = None  # why the connection broke or the client gave up

    # -- reading ----------------------------------------------------------------------------------

    def feed(self, line: str | bytes, now: float) -> bool:
        """Takes one line of the event stream, read at `now`; True when it was a chunk that
        carries choices (an arrival)."""
        if isinstance(line, bytes):
            if not line.startswith(b"data:"):
                return False
            payload: str | bytes = line[5:].strip()
            is_done = payload == b"[DONE]"
        else:
            if not line.startswith("data:"):
                return False
            payload = line[5:].strip()
            is_done = payload == "[DONE]"
        self.done = is_done
        if is_done or not payload:
            return False
        try:
            chunk = _decode(payload)
        except msgspec.DecodeError as exc:
            self.error = f"malformed event ({exc}): {payload[:120]!r}"
            return False
        if not isinstance(chunk, dict):
            self.error = f"an event that is not an object: {payload[:120]!r}"
            return False
        if "error" in chunk:
            error = chunk["error"]
            self.error = str(error.get("message", error) if isinstance(error, dict) else error)
            return False
        if usage := chunk.get("usage"):
            details = usage.get("prompt_tokens_details") or {}
            self.usage = Usage(usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0,
                               details.get("cached_tokens") or 0)
        choices = chunk.get("choices")
        if not choices:
            return False
        self.arrivals.append(now)
        content = False
        for choice in choices:
            text = choice.get("text")
            if text is None:  # a chat chunk
                text = (choice.get("delta") or {}).get("content") or ""
            self.pieces.append(text)
            content = content or bool(text)
            self.finish = choice.get("finish_reason") or self.finish
        if content:
            self.content_arrivals.append(now)
        return True

    def opened(self, status: int, headers: Iterable[tuple[str, str]], on_open: Hook | None) -> bool:
        """Takes the answer's status and headers; True (after `on_open`) when its body is a stream
        to read, False for a refusal (whose body the transport keeps in `body`)."""
        self.status = status
        self.headers = {k.lower(): v for k, v in headers}
        if status != 200:
            return False
        if on_open is not None:
            on_open(self)
        return True

    # -- what it says -----------------------------------------------------------------------------

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def ttft_s(self) -> float:
        """Seconds from sending to the first chunk that carries choices (NaN: none came)."""
        return self.arrivals[0] - self.started if self.arrivals else math.nan

    @property
    def gaps_s(self) -> list[float]:
        """Seconds between consecutive chunks that carry choices."""
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]

    @property
    def mean_itl_s(self) -> float:
        gaps = self.gaps_s
        return sum(gaps) / len(gaps) if gaps else 0.0

    @property
    def elapsed_s(self) -> float:
        """Seconds from sending to the end of the answer (a refusal's included)."""
        return self.ended - self.started

    @property
    def worker(self) -> str:
        """The decode worker that served it (x-kvmesh-worker), or ""."""
        return self.headers.get("x-kvmesh-worker", "")

    @property
    def prefill(self) -> str:
        """The prefill worker, where one prefilled it (x-kvmesh-prefill), or ""."""
        return self.headers.get("x-kvmesh-prefill", "")

    @property
    def prompt_tokens(self) -> int:
        return self.usage.prompt_tokens if self.usage else 0

    @property
    def cached_tokens(self) -> int:
        return self.usage.cached_tokens if self.usage else 0

    @property
    def completion_tokens(self) -> int:
        return self.usage.completion_tokens if self.usage else 0

    @property
    def ok(self) -> bool:
        """Answered: 200, chunks, the usage, no error event, no broken connection."""
        return (self.status == 200 and bool(self.arrivals) and self.usage is not None and self.error is None
                and self.broken is None)

    @property
    def complete(self) -> bool:
        """`ok`, and the stream ended with `[DONE]`."""
        return self.ok and self.done


def completion_body(prompt: str | Sequence[int], max_tokens: int, *, model: str = MODEL, usage: bool = True,
                    ignore_eos: bool = True, **fields: Any) -> dict[str, Any]:
    """A streamed completion's request body: the usage asked for (`usage`), exactly `max_tokens`
    tokens (`ignore_eos`), and `fields` on top."""
    body: dict[str, Any] = {"model": model, "prompt": prompt if isinstance(prompt, str) else list(prompt),
                            "max_tokens": max_tokens, "stream": True}
    if usage:
        body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(fields)
    return body


async def stream(session: aiohttp.ClientSession, path: str, body: dict[str, Any], *,
                 headers: dict[str, str] | None = None, on_open: Hook | None = None, on_chunk: Hook | None = None,
                 out: Streamed | None = None) -> Streamed:
    """POSTs `body` to `path` of the session's base URL and reads the answer to its end. `out`:
    the record to fill, so a caller that cancels the read keeps what came until then."""
    out = out if out is not None else Streamed()
    out.started = time.perf_counter()
    try:
        async with session.post(path, json=body, headers=headers) as r:
            if not out.opened(r.status, r.headers.items(), on_open):
                out.body = await r.text(errors="replace")
                return out
            async for line in r.content:
                if out.feed(line, time.perf_counter()) and on_chunk is not None:
                    on_chunk(out)
    except (aiohttp.ClientError, TimeoutError) as exc:
        out.broken = f"{type(exc).__name__} {exc}".strip()
    finally:
        out.ended = time.perf_counter()
    return out


async def stream_completion(session: aiohttp.ClientSession, prompt: str | Sequence[int], max_tokens: int, *,
                            model: str = MODEL, headers: dict[str, str] | None = None, **fields: Any) -> Streamed:
    """`stream` of `completion_body(prompt, max_tokens, model=model, **fields)` to /v1/completions."""
    return await stream(session, "/v1/completions", completion_body(prompt, max_tokens, model=model, **fields),
                        headers=headers)


def stream_sync(url: str, body: dict[str, Any], *, headers: dict[str, str] | None = None, timeout_s: float = 120,
                on_open: Hook | None = None, on_chunk: Hook | None = None) -> Streamed:
    """`stream`, blocking, with httpx: POSTs `body` to the full `url`."""
    out = Streamed(started=time.perf_counter())
    try:
        with httpx.stream("POST", url, json=body, headers=headers, timeout=timeout_s) as r:
            if not out.opened(r.status_code, r.headers.items(), on_open):
                out.body = r.read().decode(errors="replace")
                return out
            for line in r.iter_lines():
                if out.feed(line, time.perf_counter()) and on_chunk is not None:
                    on_chunk(out)
    except httpx.HTTPError as exc:
        out.broken = f"{type(exc).__name__} {exc}".strip()
    finally:
        out.ended = time.perf_counter()
    return out
