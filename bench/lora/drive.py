"""One run's client: the workload's requests sent open-loop, what each response says kept per request.

The warm-up requests go first, at the workload's rate, and are waited for; then `between` runs (the caller
snapshots the workers' counters there, so the warm-up's loads are left out) and the measured requests follow.
Every phase is bounded: arrivals stop at its time limit (the rest count as not sent), and a request still
open at the end of the phase's grace is cut and counted as failed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from bench.lora.workload import Request
from testkit.sse import stream_completion

MAX_INFLIGHT = 256
REQUEST_TIMEOUT_S = 60.0
GRACE_S = 60.0  # how long the last requests of a phase may take after its last arrival


@dataclass(frozen=True, slots=True)
class Outcome:
    adapter: str
    ok: bool
    ttft_ms: float = float("nan")
    prompt_tokens: int = 0
    cached_tokens: int = 0
    worker: str = ""


@dataclass
class Phase:
    outcomes: list[Outcome] = field(default_factory=list)
    not_sent: int = 0
    cut: int = 0
    seconds: float = 0.0

    @property
    def done(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.ok]

    @property
    def failures(self) -> int:
        return sum(not o.ok for o in self.outcomes) + self.not_sent + self.cut


async def _one(session: aiohttp.ClientSession, request: Request, output_tokens: int) -> Outcome:
    r = await stream_completion(session, request.tokens, output_tokens, model=request.adapter)
    if not r.ok:
        return Outcome(request.adapter, ok=False, worker=r.worker)
    return Outcome(request.adapter, True, r.ttft_s * 1000, r.prompt_tokens, r.cached_tokens, r.worker)


async def _phase(session: aiohttp.ClientSession, requests: Sequence[Request], output_tokens: int,
                 time_limit_s: float) -> Phase:
    phase = Phase()
    limit = asyncio.Semaphore(MAX_INFLIGHT)

    async def limited(request: Request) -> None:
        async with limit:
            phase.outcomes.append(await _one(session, request, output_tokens))

    started = time.monotonic()
    deadline = started + time_limit_s
    tasks = []
    for request in requests:
        await asyncio.sleep(request.gap_s)
        if time.monotonic() > deadline:
            break
        tasks.append(asyncio.create_task(limited(request)))
    phase.not_sent = len(requests) - len(tasks)
    _, pending = await asyncio.wait(tasks, timeout=GRACE_S) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    phase.cut = len(pending)
    phase.seconds = time.monotonic() - started
    return phase


async def drive(base: str, requests: Sequence[Request], output_tokens: int, time_limit_s: float,
                between: Callable[[], Awaitable[None]]) -> tuple[Phase, Phase]:
    """The warm-up phase and the measured phase of one run against the mesh at `base`."""
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=MAX_INFLIGHT)
    async with aiohttp.ClientSession(base, timeout=timeout, connector=connector) as session:
        warmup = await _phase(session, [r for r in requests if r.warmup], output_tokens, time_limit_s)
        await between()
        measured = await _phase(session, [r for r in requests if not r.warmup], output_tokens, time_limit_s)
    return warmup, measured
