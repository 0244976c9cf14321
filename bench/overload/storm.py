"""The overload benchmark's load: Poisson arrivals per tenant, each a streamed completion whose
outcome is kept whole (served, refused with what status and Retry-After how fast, or broken)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import aiohttp

from testkit.sse import Streamed, completion_body, stream

# Per request: a tenant prefix, then words of its own (~100 tokens), and this many tokens out.
PROMPT_WORDS = 90
MAX_TOKENS = 32


@dataclass
class Outcome:
    tenant: str
    high: bool
    sent_at: float
    status: int = 0
    ttft_s: float = float("nan")
    done_s: float = float("nan")
    # Seconds from sending to the refusal's response, and its Retry-After headers.
    refused_s: float = float("nan")
    retry_after: str = ""
    retry_after_ms: str = ""
    # The refusal's error code and the start of its message (which says why).
    error_code: str = ""
    reason: str = ""
    # Status 200 that did not end with usage and [DONE]: a broken stream.
    broken: bool = False
    # Never answered within the client's own time limit.
    timed_out: bool = False
    # What the mesh says it waited in the router's queue (x-kvmesh-queue-wait-ms).
    queue_wait_s: float = 0.0

    @property
    def served(self) -> bool:
        return self.status == 200 and not self.broken and not self.timed_out

    def within(self, slo_s: float) -> bool:
        return self.served and self.ttft_s <= slo_s


@dataclass(frozen=True)
class Flow:
    """One tenant's arrivals: `rate` requests per second from `start` to `stop` (seconds into
    the run); `high_share` of them carry a high priority."""

    tenant: str
    key: str
    rate: float
    start: float
    stop: float
    high_share: float = 0.0


def prompt(tenant: str, rng: random.Random) -> str:
    words = [f"{tenant}-context"] * 8 + [f"w{rng.randrange(5000)}" for _ in range(PROMPT_WORDS)]
    return " ".join(words)


async def one(session: aiohttp.ClientSession, flow: Flow, high: bool, rng: random.Random, t0: float,
              timeout_s: float, extra_headers: dict[str, str] | None = None) -> Outcome:
    body = completion_body(prompt(flow.tenant, rng), MAX_TOKENS)
    if high:
        body["priority"] = -1
    headers = {"authorization": f"Bearer {flow.key}", **(extra_headers or {})}
    s = Streamed()
    out = Outcome(flow.tenant, high, time.perf_counter() - t0)
    try:
        async with asyncio.timeout(timeout_s):
            await stream(session, "/v1/completions", body, headers=headers, out=s)
    except TimeoutError:
        out.status, out.timed_out = s.status, True
        return out
    out.status = s.status if s.status or s.broken is None else -1
    if s.broken is not None:  # the connection failed: broken once the answer had begun
        out.broken = s.status == 200
    elif s.status != 200:
        out.refused_s = s.elapsed_s
        try:
            error = json.loads(s.body)["error"]
            out.error_code, out.reason = error.get("code") or "", (error.get("message") or "")[:40]
        except (ValueError, KeyError, TypeError, AttributeError):
            out.reason = s.body[:40]
        out.retry_after = s.headers.get("retry-after", "")
        out.retry_after_ms = s.headers.get("retry-after-ms", "")
    else:
        out.queue_wait_s = int(s.headers.get("x-kvmesh-queue-wait-ms", "0")) / 1000
        out.ttft_s = s.ttft_s
        out.broken = s.error is not None or not (s.usage is not None and s.done)
        out.done_s = s.elapsed_s
    return out


async def run_flows(base: str, flows: list[Flow], seed: int, timeout_s: float = 90.0,
                    headers: dict[str, str] | None = None) -> list[Outcome]:
    """Sends every flow's Poisson arrivals, then waits for every answer (bounded by `timeout_s`)."""
    rng = random.Random(seed)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(base, connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        t0 = time.perf_counter()
        schedule: list[tuple[float, Flow, bool]] = []
        for flow in flows:
            t = flow.start
            while True:
                t += rng.expovariate(flow.rate)
                if t >= flow.stop:
                    break
                schedule.append((t, flow, rng.random() < flow.high_share))
        schedule.sort(key=lambda x: x[0])
        tasks = []
        for at, flow, high in schedule:
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(session, flow, high, random.Random(rng.random()), t0, timeout_s,
                                                 headers)))
        return list(await asyncio.gather(*tasks))


async def closed_loop(base: str, key: str, streams: int, seconds: float,
                      headers: dict[str, str] | None = None) -> float:
    """Completed requests per second with `streams` clients sending back to back (the capacity)."""
    rng = random.Random(1)
    flow = Flow("capacity", key, 1.0, 0, seconds)
    done = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(base, connector=connector) as session:
        t0 = time.perf_counter()
        stop = t0 + seconds

        async def client() -> None:
            nonlocal done
            while time.perf_counter() < stop:
                out = await one(session, flow, False, random.Random(rng.random()), t0, 60, headers)
                if out.served and time.perf_counter() <= stop:
                    done += 1

        await asyncio.gather(*(client() for _ in range(streams)))
        return done / seconds


async def idle_ttft(base: str, key: str, count: int = 10) -> float:
    """The median time to first token of requests sent one at a time."""
    rng = random.Random(2)
    flow = Flow("idle", key, 1.0, 0, 1)
    async with aiohttp.ClientSession(base) as session:
        ttfts = [(await one(session, flow, False, random.Random(rng.random()), 0.0, 60)).ttft_s for _ in range(count)]
    return sorted(ttfts)[len(ttfts) // 2]
