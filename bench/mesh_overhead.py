"""Mesh overhead: 1-token completions through all five processes vs the same engine in-process.

The mocker runs with `--speedup inf` (no simulated compute), so what is measured is the cost of
HTTP, three gRPC hops, tokenization and detokenization. Both sides run in the same invocation on
the same machine; the ratio column is mesh / direct.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp

from testkit.mesh import launched
from testkit.sse import completion_body, stream
from bench.common.report import bar_plot, median, percentile, save_json, table
from services.engines.base import EngineRequest, Sampling
from services.engines.mocker.engine import MockerConfig, MockerEngine
from services.engines.mocker.timing import TimingModel
from services.tools.make_demo_model import ensure_demo_model

CONCURRENCY = (1, 16, 64)
REQUESTS_PER_LEVEL = {1: 400, 16: 2000, 64: 3000}
LEVEL_TIME_LIMIT_S = 60.0
STREAM_TOKENS = 64
STREAM_REQUESTS = 30
PROMPT = "The router keeps a tree of the cached blocks of every worker."


@dataclass
class Level:
    concurrency: int
    requests: int
    seconds: float
    latencies_ms: list[float]

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def p50(self) -> float:
        return percentile(self.latencies_ms, 50)

    @property
    def p99(self) -> float:
        return percentile(self.latencies_ms, 99)


async def drive(concurrency: int, total: int, one, time_limit_s: float = LEVEL_TIME_LIMIT_S) -> Level:
    """`total` calls of `one` by `concurrency` clients (stopping at `time_limit_s`), timed."""
    latencies: list[float] = []
    remaining = total
    deadline = time.perf_counter() + time_limit_s

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0 and time.perf_counter() < deadline:
            remaining -= 1
            t0 = time.perf_counter()
            await one()
            latencies.append((time.perf_counter() - t0) * 1000)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return Level(concurrency, len(latencies), time.perf_counter() - started, latencies)


async def direct_levels(prompt_ids: list[int]) -> tuple[list[Level], list[float]]:
    engine = MockerEngine(MockerConfig(str(ensure_demo_model()), "demo", timing=TimingModel(speedup=float("inf"))))
    await engine.start()
    counter = iter(range(10**9))

    async def one() -> None:
        async for _ in engine.generate(EngineRequest(f"d{next(counter)}", prompt_ids, Sampling(max_tokens=1))):
            pass

    try:
        levels = [await drive(c, REQUESTS_PER_LEVEL[c], one) for c in CONCURRENCY]
        gaps: list[float] = []
        for i in range(STREAM_REQUESTS):
            last = None
            async for _ in engine.generate(EngineRequest(f"s{i}", prompt_ids, Sampling(max_tokens=STREAM_TOKENS))):
                now = time.perf_counter()
                if last is not None:
                    gaps.append((now - last) * 1000)
                last = now
        return levels, gaps
    finally:
        await engine.stop()


async def mesh_levels(base: str) -> tuple[list[Level], list[float]]:
    body = {"model": "kvmesh-demo", "prompt": PROMPT, "max_tokens": 1}
    connector = aiohttp.TCPConnector(limit=max(CONCURRENCY) * 2)
    async with aiohttp.ClientSession(base, connector=connector) as session:
        async def one() -> None:
            async with session.post("/v1/completions", json=body) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"mesh answered {r.status}: {await r.text()}")

        for _ in range(50):  # warm-up: connections, code paths
            await one()
        levels = [await drive(c, REQUESTS_PER_LEVEL[c], one) for c in CONCURRENCY]
        gaps: list[float] = []
        stream_body = completion_body(PROMPT, STREAM_TOKENS, usage=False, ignore_eos=False)
        for _ in range(STREAM_REQUESTS):
            streamed = await stream(session, "/v1/completions", stream_body)
            gaps += [gap * 1000 for gap in streamed.gaps_s]
        return levels, gaps


def run() -> dict:
    print("mesh overhead: direct in-process engine ...", flush=True)
    from services.processor.tokenizer import ModelTokenizer

    prompt_ids = ModelTokenizer(str(ensure_demo_model())).encode_text(PROMPT)
    direct, direct_gaps = asyncio.run(direct_levels(prompt_ids))
    print("mesh overhead: whole mesh (frontend, processor, router, worker) ...", flush=True)
    with launched("--engine", "mocker", "--speedup", "inf", "--decode-workers", "1") as base:
        mesh, mesh_gaps = asyncio.run(mesh_levels(base))
    rows = []
    for d, m in zip(direct, mesh):
        rows.append([m.concurrency, m.requests, d.rps, m.rps, m.rps / d.rps, d.p50, m.p50, m.p50 - d.p50, d.p99, m.p99])
    table("Mesh overhead (mocker, zero compute, 1-token completions)",
          ["conc", "reqs", "direct req/s", "mesh req/s", "mesh/direct", "direct p50 ms", "mesh p50 ms",
           "added p50 ms", "direct p99 ms", "mesh p99 ms"], rows)
    itl_direct, itl_mesh = median(direct_gaps), median(mesh_gaps)
    table(f"Streaming ({STREAM_TOKENS} tokens, concurrency 1): time between tokens",
          ["path", "p50 ms", "p99 ms"],
          [["direct", itl_direct, percentile(direct_gaps, 99)], ["mesh", itl_mesh, percentile(mesh_gaps, 99)],
           ["added by the mesh", itl_mesh - itl_direct, percentile(mesh_gaps, 99) - percentile(direct_gaps, 99)]])
    bar_plot("mesh_overhead_rps", "1-token completions per second", [str(c) for c in CONCURRENCY],
             {"direct engine": [d.rps for d in direct], "through the mesh": [m.rps for m in mesh]}, "requests/s")
    result = {
        "levels": [{"concurrency": m.concurrency, "direct_rps": d.rps, "mesh_rps": m.rps, "direct_p50_ms": d.p50,
                    "mesh_p50_ms": m.p50, "direct_p99_ms": d.p99, "mesh_p99_ms": m.p99} for d, m in zip(direct, mesh)],
        "itl_p50_ms": {"direct": itl_direct, "mesh": itl_mesh},
    }
    save_json("mesh_overhead", result)
    return result
