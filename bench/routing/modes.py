"""Routing quality: the same prefix-heavy workload on 8 mocker workers under kv, round-robin, random.

Workload: 64 shared 2048-token prefixes, each request one of them (uniformly) plus a fresh
256-token suffix, 8 output tokens, Poisson arrivals at a fixed rate. Each worker's KV cache holds
2048 blocks of 16 tokens (about 14 prefixes), so all 64 fit only if the router partitions them.
The mocker uses its default timing model (an 8B model on an H100-class GPU, see
services/engines/mocker/timing.py). Each mode gets a fresh mesh; every prefix is sent once
before measuring, so the numbers are steady state.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp

from bench.common.client import ReuseTally
from testkit.mesh import launched
from testkit.sse import stream_completion
from bench.common.report import bar_plot, percentile, save_json, table

WORKERS = 8
PREFIXES = 64
PREFIX_TOKENS = 2048
SUFFIX_TOKENS = 256
OUTPUT_TOKENS = 8
RATE_PER_S = 20.0
REQUESTS = 500
NUM_GPU_BLOCKS = 2048
MODES = ("kv", "round-robin", "random")
MAX_INFLIGHT = 256
TIME_LIMIT_S = 120.0


@dataclass
class ModeResult(ReuseTally):
    mode: str = ""
    per_worker: Counter = field(default_factory=Counter)

    @property
    def max_over_mean(self) -> float:
        counts = list(self.per_worker.values()) + [0] * (WORKERS - len(self.per_worker))
        return max(counts) / (sum(counts) / WORKERS) if sum(counts) else 0.0


def prompts(seed: int) -> tuple[list[list[int]], random.Random]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(PREFIX_TOKENS)] for _ in range(PREFIXES)], rng


async def one(session: aiohttp.ClientSession, tokens: list[int], result: ModeResult | None) -> None:
    outcome = await stream_completion(session, tokens, OUTPUT_TOKENS)
    if result is not None and result.add(outcome):
        result.per_worker[outcome.worker] += 1


async def drive(base: str, mode: str) -> ModeResult:
    prefixes, rng = prompts(seed=1)
    result = ModeResult(mode=mode)
    limit = asyncio.Semaphore(MAX_INFLIGHT)
    async with aiohttp.ClientSession(base, timeout=aiohttp.ClientTimeout(total=60)) as session:
        for p in prefixes:  # warm-up: every prefix once
            await one(session, p + [rng.randrange(10, 1000) for _ in range(SUFFIX_TOKENS)], None)
        tasks = []
        deadline = time.monotonic() + TIME_LIMIT_S

        async def limited(tokens: list[int]) -> None:
            async with limit:
                await one(session, tokens, result)

        for _ in range(REQUESTS):
            if time.monotonic() > deadline:
                break
            tokens = rng.choice(prefixes) + [rng.randrange(10, 1000) for _ in range(SUFFIX_TOKENS)]
            tasks.append(asyncio.create_task(limited(tokens)))
            await asyncio.sleep(rng.expovariate(RATE_PER_S))
        await asyncio.wait_for(asyncio.gather(*tasks), TIME_LIMIT_S)
    return result


def run() -> dict:
    results = []
    for mode in MODES:
        print(f"routing quality: {mode} ...", flush=True)
        with launched("--engine", "mocker", "--decode-workers", str(WORKERS), "--router-mode", mode,
                      "--num-gpu-blocks", str(NUM_GPU_BLOCKS)) as base:
            results.append(asyncio.run(drive(base, mode)))
    rr = next(r for r in results if r.mode == "round-robin")
    rr_p90 = percentile(rr.ttft_ms, 90)
    rows = []
    for r in results:
        p90 = percentile(r.ttft_ms, 90)
        rows.append([r.mode, len(r.ttft_ms), r.failures, f"{r.hit_rate:.1%}", percentile(r.ttft_ms, 50), p90,
                     rr_p90 / p90 if p90 else float("nan"), f"{r.max_over_mean:.2f}",
                     " ".join(str(c) for _, c in sorted(r.per_worker.items()))])
    table(f"Routing quality: {WORKERS} mocker workers, {PREFIXES} x {PREFIX_TOKENS}-token prefixes + "
          f"{SUFFIX_TOKENS}-token suffixes, {RATE_PER_S:g} req/s",
          ["mode", "requests", "failed", "KV hit rate", "TTFT p50 ms", "TTFT p90 ms", "p90 gain vs RR",
           "max/mean reqs", "requests per worker"], rows)
    bar_plot("routing_quality_ttft", "TTFT by router mode (ms)", [r.mode for r in results],
             {"p50": [percentile(r.ttft_ms, 50) for r in results], "p90": [percentile(r.ttft_ms, 90) for r in results]},
             "ms")
    data = {r.mode: {"hit_rate": r.hit_rate, "ttft_p50_ms": percentile(r.ttft_ms, 50),
                     "ttft_p90_ms": percentile(r.ttft_ms, 90), "per_worker": dict(r.per_worker),
                     "failures": r.failures} for r in results}
    save_json("routing_quality", data)
    return data
