"""Steady load on the mesh across hosts, and every answer checked afterwards.

Each request has a prompt of its own (a counter and a tag ahead of the filler), so no answer is
served from another request's cache and a long prompt is prefilled with nothing cached, on the
prefill pool where there is one. The answer is a function of the prompt (the mocker's always,
vLLM's greedy one, which is what is asked for), so once a fault is healed each prompt is asked
again: an answer that differs was corrupted on the way (a token lost, doubled or out of place in
a migration, a generation run twice into one stream); a request that got no answer failed, with
the error the client saw. `under_load` runs one fault that way: load, fault, heal, time to
recover, check.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from bench.hosts.faults import Fault
from bench.hosts.mesh import HostsMesh
from services.profiles.stats import percentile

MODEL = "kvmesh-demo"
TOKENS = 120
SEED = 7
# ~90 tokens, and ~700 (above the decode workers' local prefill limit, 256 tokens in the bed).
SHORT_FILLER, LONG_FILLER = "lorem ipsum " * 12, "lorem ipsum " * 100
CHECK_CONCURRENCY = 16
DRAIN_TIMEOUT_S = 120.0
RECOVER_TIMEOUT_S = 60.0
SETTLE_S = 1.0


@dataclass
class Outcome:
    prompt: str
    seconds: float
    text: str | None = None
    error: str | None = None


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)
    exact: int = 0
    corrupted: int = 0
    # Answers whose prompt could not be asked again after the heal (neither exact nor corrupted).
    unverified: int = 0

    @property
    def sent(self) -> int:
        return len(self.outcomes)

    @property
    def answered(self) -> int:
        return sum(o.text is not None for o in self.outcomes)

    @property
    def failures(self) -> list[str]:
        return [o.error or "no answer" for o in self.outcomes if o.text is None]

    def latency(self, q: float) -> float:
        """The answered requests' latency at quantile `q` (0..1); NaN with none answered."""
        return percentile([o.seconds for o in self.outcomes if o.text is not None], q * 100)


async def answer(client: httpx.AsyncClient, base: str, prompt: str) -> str:
    r = await client.post(f"{base}/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": TOKENS,
                                                      "seed": SEED, "temperature": 0})
    if r.status_code != 200:
        raise httpx.HTTPStatusError(f"{r.status_code}: {r.text[:160]}", request=r.request, response=r)
    return str(r.json()["choices"][0]["text"])


async def _one(client: httpx.AsyncClient, base: str, outcome: Outcome) -> None:
    started = time.monotonic()
    try:
        outcome.text = await answer(client, base, outcome.prompt)
    except asyncio.CancelledError:
        outcome.error = "not answered in time (cancelled)"
        raise
    except Exception as exc:  # noqa: BLE001 - whatever went wrong, the client saw no answer
        outcome.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        outcome.seconds = time.monotonic() - started


async def steady(client: httpx.AsyncClient, base: str, tag: str, rate: float, long_share: float,
                 stop: asyncio.Event, tally: Tally) -> None:
    """Poisson arrivals at `rate` per second until `stop`; then waits up to DRAIN_TIMEOUT_S for
    those in flight. Whatever is still running then, or when this is cancelled, is cancelled and
    counts as failed."""
    rng = random.Random(tag)
    running: set[asyncio.Task[None]] = set()
    try:
        n = 0
        while not stop.is_set():
            # The counter first: no two prompts share a first KV block, so none is routed by a
            # prefix the others cached.
            outcome = Outcome(f"{n} {tag}: {LONG_FILLER if rng.random() < long_share else SHORT_FILLER}", 0.0)
            tally.outcomes.append(outcome)
            task = asyncio.create_task(_one(client, base, outcome))
            n += 1
            running.add(task)
            task.add_done_callback(running.discard)
            try:
                await asyncio.wait_for(stop.wait(), rng.expovariate(rate))
            except TimeoutError:
                pass
        if running:
            await asyncio.wait(running, timeout=DRAIN_TIMEOUT_S)
    finally:
        left = list(running)
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)


async def check(client: httpx.AsyncClient, base: str, tally: Tally) -> None:
    """Asks every answered prompt again on the healed mesh and counts exact and corrupted answers
    (and those it could not ask again)."""
    gate = asyncio.Semaphore(CHECK_CONCURRENCY)

    async def again(outcome: Outcome) -> bool:
        async with gate:
            return await answer(client, base, outcome.prompt) == outcome.text

    answered = [o for o in tally.outcomes if o.text is not None]
    same = await asyncio.gather(*(again(o) for o in answered), return_exceptions=True)
    tally.exact = sum(s is True for s in same)
    tally.corrupted = sum(s is False for s in same)
    tally.unverified = sum(isinstance(s, BaseException) for s in same)


@dataclass
class Row:
    fault: str
    tally: Tally
    # Seconds from the heal until the instances the fault took out of etcd were back (None: it
    # took none out; inf: not within RECOVER_TIMEOUT_S).
    recover_s: float | None
    note: str
    problem: str | None = None  # what the mesh failed to do besides answering


async def recovered_after(check: Callable[[], Awaitable[bool]]) -> float:
    healed = time.monotonic()
    while time.monotonic() - healed < RECOVER_TIMEOUT_S:
        if await check():
            return time.monotonic() - healed
        await asyncio.sleep(0.2)
    return float("inf")


async def under_load(mesh: HostsMesh, client: httpx.AsyncClient, fault: Fault | None, hold_s: float, rate: float,
                     long_share: float) -> Row:
    """`fault` (None: none) applied for `hold_s` under steady load, healed, and the answers checked."""
    name = fault.name if fault else "no fault (baseline)"
    print(f"hosts: {name}, {hold_s:.0f}s ...", flush=True)
    tally, stop = Tally(), asyncio.Event()
    load = asyncio.create_task(steady(client, mesh.base_url, name, rate, long_share, stop, tally))
    row = Row(name, tally, None, "")
    try:
        await asyncio.sleep(SETTLE_S)
        if fault is None:
            await asyncio.sleep(hold_s)
        else:
            await _apply(fault, hold_s, row)
    except asyncio.CancelledError:
        load.cancel()  # Ctrl-C: the requests in flight are dropped, not waited for
        raise
    finally:
        stop.set()
        await asyncio.gather(load, return_exceptions=True)
    await check(client, mesh.base_url, tally)
    recovered = "nobody left etcd" if row.recover_s is None else f"registered again {row.recover_s:.1f}s after the heal"
    print(f"hosts: {name}: {tally.exact}/{tally.sent} exact, {tally.corrupted} corrupted, {len(tally.failures)} "
          f"failed, p99 {tally.latency(0.99):.1f}s, {recovered}. {row.note} {row.problem or ''}", flush=True)
    return row


async def _apply(fault: Fault, hold_s: float, row: Row) -> None:
    """Starts the fault, holds it, heals it (also when starting failed half-way), and records
    the recovery, the note and the verdict on `row`."""
    try:
        await fault.start()
        await asyncio.sleep(hold_s)
    finally:
        await fault.end()
    if fault.recovered is not None:
        row.recover_s = await recovered_after(fault.recovered)
    row.note = await fault.note() if fault.note else ""
    row.problem = await fault.passed() if fault.passed else None
