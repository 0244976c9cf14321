"""The chaos run's load and its verification.

A seeded catalogue of distinct requests — short text prompts (prefilled on the decode worker)
and long token-id prompts (above the local prefill limit, so they go to a prefill worker unless
cached) — every one streamed with `ignore_eos`, a fixed `max_tokens`, and `temperature: 0` or a
fixed `seed`. The mocker's output is a pure function of the prompt, the sampling parameters and
the position, so every completed stream of one catalogue entry must carry exactly the same text
(`verify` asks the healthy mesh once per entry afterwards and compares).

`drive` sends requests at the given rate from a bounded pool of clients for a bounded time and
records every outcome: completed, or failed (an HTTP error, an SSE error event, or a stream that
broke or ended without `[DONE]`), with the text and the `x-kvmesh-worker` / `x-kvmesh-prefill`
headers.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp

from testkit.sse import Streamed, completion_body, stream

MODEL = "kvmesh-demo"
WORDS = ("mesh", "router", "prefill", "decode", "cache", "block", "token", "stream", "etcd", "lease",
         "drain", "migrate", "worker", "kernel", "batch", "queue", "radix", "hash", "chaos", "fault")
STREAM_TIMEOUT_S = 90.0


@dataclass(frozen=True)
class RequestSpec:
    """One distinct request of the catalogue."""

    key: int
    prompt: str | tuple[int, ...]
    seed: int | None  # None: greedy (temperature 0)

    @property
    def long(self) -> bool:
        return not isinstance(self.prompt, str)

    def body(self, max_tokens: int) -> dict:
        if self.seed is None:
            return completion_body(self.prompt, max_tokens, model=MODEL, temperature=0.0)
        return completion_body(self.prompt, max_tokens, model=MODEL, temperature=0.8, seed=self.seed)


def catalogue(seed: int, shorts: int, longs: int, long_tokens: tuple[int, int] = (300, 600)) -> list[RequestSpec]:
    """`shorts` text prompts and `longs` token-id prompts; every other one seeded, the rest greedy."""
    rng = random.Random(seed)
    specs: list[RequestSpec] = []
    for key in range(shorts + longs):
        if key < shorts:
            prompt: str | tuple[int, ...] = f"chaos {seed}/{key}: " + " ".join(rng.choices(WORDS, k=rng.randint(5, 30)))
        else:
            prompt = tuple(rng.randrange(20, 1000) for _ in range(rng.randint(*long_tokens)))
        specs.append(RequestSpec(key, prompt, seed=1000 + key if key % 2 else None))
    return specs


@dataclass
class Outcome:
    key: int
    sent_s: float
    ended_s: float = 0.0
    status: int = 0
    worker: str = ""
    prefill: str = ""
    text: str = ""
    finish: str = ""
    completion_tokens: int = -1
    error: str = ""

    @property
    def completed(self) -> bool:
        return not self.error


async def stream_one(session: aiohttp.ClientSession, spec: RequestSpec, max_tokens: int, t0: float,
                     inflight: dict[int, str] | None = None) -> Outcome:
    """One streamed completion, read to its end; never raises for what the mesh does."""
    out = Outcome(spec.key, round(time.monotonic() - t0, 2))
    token = id(out)

    def opened(s: Streamed) -> None:
        if inflight is not None:
            inflight[token] = s.worker

    try:
        s = await stream(session, "/v1/completions", spec.body(max_tokens), on_open=opened)
    finally:
        out.ended_s = round(time.monotonic() - t0, 2)
        if inflight is not None:
            inflight.pop(token, None)
    out.status, out.worker, out.prefill = s.status, s.worker, s.prefill
    out.text, out.finish = s.text, s.finish or ""
    out.completion_tokens = s.usage.completion_tokens if s.usage else -1
    out.error = failure(s)
    return out


def failure(s: Streamed) -> str:
    """What went wrong with a stream ('' for one that ended properly)."""
    if s.broken is not None:
        return f"broken stream: {s.broken}"
    if s.status != 200:
        return f"HTTP {s.status}: {s.body[:160]}"
    if s.error is not None:
        return f"SSE error event: {s.error}"
    return "" if s.done else "broken stream: ended without [DONE]"


@dataclass
class Load:
    """Outcomes of the load, and which decode worker each in-flight stream is on right now."""

    outcomes: list[Outcome] = field(default_factory=list)
    inflight: dict[int, str] = field(default_factory=dict)
    sent: int = 0

    def busy(self) -> Counter[str]:
        return Counter(self.inflight.values())


async def drive(base_url: str, specs: list[RequestSpec], seed: int, rate: float, until: asyncio.Event,
                max_requests: int, clients: int, max_tokens: int, t0: float, load: Load) -> None:
    """Sends seeded picks from `specs` with exponential gaps at `rate`/s, at most `clients` at a
    time and `max_requests` in all, until `until` is set; then waits for what is in flight."""
    rng = random.Random(seed + 17)
    pool = asyncio.Semaphore(clients)
    tasks: list[asyncio.Task[None]] = []
    timeout = aiohttp.ClientTimeout(total=STREAM_TIMEOUT_S)
    async with aiohttp.ClientSession(base_url, timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=clients)) as session:
        async def one(spec: RequestSpec) -> None:
            try:
                load.outcomes.append(await stream_one(session, spec, max_tokens, t0, load.inflight))
            finally:
                pool.release()

        try:
            while not until.is_set() and load.sent < max_requests:
                await pool.acquire()
                load.sent += 1
                tasks.append(asyncio.create_task(one(rng.choice(specs))))
                try:
                    await asyncio.wait_for(until.wait(), rng.expovariate(rate))
                except TimeoutError:
                    pass
            if tasks:
                await asyncio.wait(tasks, timeout=STREAM_TIMEOUT_S + 10)
        finally:
            # Whatever is left unanswered counts as failed (sent but no outcome).
            for task in tasks:
                task.cancel()


@dataclass
class Verdict:
    corrupted: list[tuple[Outcome, str]] = field(default_factory=list)  # (outcome, what differs)
    unverified: list[Outcome] = field(default_factory=list)
    references: int = 0


async def verify(base_url: str, specs: list[RequestSpec], outcomes: list[Outcome], max_tokens: int,
                 t0: float) -> Verdict:
    """Sends each catalogue entry that completed during the run once more, one at a time, to
    the healthy mesh (up to 3 tries), and compares every completed stream with it."""
    by_key = {s.key: s for s in specs}
    verdict = Verdict()
    references: dict[int, Outcome] = {}
    timeout = aiohttp.ClientTimeout(total=STREAM_TIMEOUT_S)
    async with aiohttp.ClientSession(base_url, timeout=timeout) as session:
        for key in sorted({o.key for o in outcomes if o.completed}):
            for _ in range(3):
                ref = await stream_one(session, by_key[key], max_tokens, t0)
                if ref.completed and ref.completion_tokens == max_tokens:
                    references[key] = ref
                    break
    verdict.references = len(references)
    for o in outcomes:
        if not o.completed:
            continue
        want = references.get(o.key)
        if want is None:
            verdict.unverified.append(o)
        elif (why := difference(o, want, max_tokens)) is not None:
            verdict.corrupted.append((o, why))
    return verdict


def difference(got: Outcome, want: Outcome, max_tokens: int) -> str | None:
    """None when `got` is the expected stream; otherwise what differs."""
    if got.completion_tokens != max_tokens:
        return f"{got.completion_tokens} completion tokens (want {max_tokens})"
    if got.finish != "length":
        return f"finish_reason {got.finish!r} (want 'length')"
    if got.text != want.text:
        at = next((i for i, (a, b) in enumerate(zip(got.text, want.text)) if a != b), min(len(got.text), len(want.text)))
        return (f"text differs at char {at} of {len(want.text)} (got {len(got.text)} chars): "
                f"got {got.text[at:at + 24]!r}, want {want.text[at:at + 24]!r}")
    return None
