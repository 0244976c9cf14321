"""The planner benchmark's workload: a two-phase, open-loop Poisson schedule and its replay.

Phase A sends long prompts with short outputs, phase B short prompts with long outputs; in the
ramp between them the arrival rate moves linearly from A's to B's and the share of A-shaped
requests from 1 to 0. The schedule (arrival times, shapes, prompt tokens) depends only on the
workload and its seed, so every configuration is sent exactly the same requests at the same
times. A request belongs to the phase it arrived in.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp

from testkit.sse import Streamed, stream_completion

PHASES = ("A", "ramp", "B")
# Token ids of the random prompts: above the demo tokenizer's special tokens, inside its vocabulary (1114 ids).
TOKEN_LOW, TOKEN_HIGH = 20, 1000


@dataclass(frozen=True)
class Shape:
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Workload:
    phase_a_s: float
    ramp_s: float
    phase_b_s: float
    rate_a: float
    rate_b: float
    shape_a: Shape
    shape_b: Shape
    seed: int = 1

    @property
    def duration_s(self) -> float:
        return self.phase_a_s + self.ramp_s + self.phase_b_s

    def bounds(self) -> dict[str, tuple[float, float]]:
        """Start and end (seconds from the first arrival) of each phase."""
        ramp_end = self.phase_a_s + self.ramp_s
        return {"A": (0.0, self.phase_a_s), "ramp": (self.phase_a_s, ramp_end), "B": (ramp_end, self.duration_s)}

    def phase_of(self, t: float) -> str:
        return next(name for name, (start, end) in self.bounds().items() if t < end or name == "B")

    def share_a(self, t: float) -> float:
        """Share of A-shaped requests among the arrivals at time t."""
        return min(1.0, max(0.0, 1.0 - (t - self.phase_a_s) / self.ramp_s)) if self.ramp_s else float(t < self.phase_a_s)

    def rate(self, t: float) -> float:
        share = self.share_a(t)
        return share * self.rate_a + (1.0 - share) * self.rate_b


@dataclass(frozen=True)
class Arrival:
    at_s: float
    phase: str
    shape: Shape
    # Seeds this request's prompt tokens (random, so no two prompts share a cached prefix).
    token_seed: int

    def tokens(self) -> list[int]:
        rng = random.Random(self.token_seed)
        return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(self.shape.prompt_tokens)]


def schedule(w: Workload) -> list[Arrival]:
    """A non-homogeneous Poisson process by thinning: candidates at the highest rate, each kept
    with probability rate(t) / highest."""
    rng = random.Random(w.seed)
    peak = max(w.rate_a, w.rate_b)
    arrivals: list[Arrival] = []
    t = rng.expovariate(peak)
    while t < w.duration_s:
        keep, pick_a = rng.random() < w.rate(t) / peak, rng.random() < w.share_a(t)
        if keep:
            arrivals.append(Arrival(t, w.phase_of(t), w.shape_a if pick_a else w.shape_b, rng.getrandbits(32)))
        t += rng.expovariate(peak)
    return arrivals


@dataclass
class Outcome:
    arrival: Arrival
    result: Streamed
    # Seconds from the start of the replay to the request's first token (NaN if none).
    first_token_at_s: float
    error: str = ""

    def good(self, ttft_slo_s: float, itl_slo_s: float) -> bool:
        r = self.result
        return r.ok and r.ttft_s <= ttft_slo_s and r.mean_itl_s <= itl_slo_s


async def _one(session: aiohttp.ClientSession, arrival: Arrival, started: float) -> Outcome:
    sent = time.perf_counter()
    result = await stream_completion(session, arrival.tokens(), arrival.shape.output_tokens)
    if result.broken is not None:  # one broken stream is a failed request, not a lost run
        return Outcome(arrival, result, float("nan"), result.broken)
    return Outcome(arrival, result, sent - started + result.ttft_s)


async def replay(base: str, arrivals: list[Arrival], request_timeout_s: float, drain_s: float,
                 on_start: Callable[[], Awaitable[None]] | None = None) -> list[Outcome]:
    """Sends each arrival at its time (open loop: never waits for answers), then waits up to
    `drain_s` for the last answers; a request still unanswered then counts as failed.
    `on_start` runs at time zero (the split sampler starts with the load)."""
    # Hundreds of streams are open at once in the decode-heavy phase: no connection limit.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    async with aiohttp.ClientSession(base, connector=connector, timeout=timeout) as session:
        started = time.perf_counter()
        if on_start is not None:
            await on_start()
        tasks: list[asyncio.Task[Outcome]] = []
        for arrival in arrivals:
            delay = started + arrival.at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(session, arrival, started)))
        done, pending = await asyncio.wait(tasks, timeout=drain_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return [t.result() if t in done else Outcome(a, Streamed(), float("nan"), "unanswered at the deadline")
            for t, a in zip(tasks, arrivals, strict=True)]
