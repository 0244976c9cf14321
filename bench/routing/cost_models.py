"""The cached-share cost rule against NVIDIA Dynamo's (`--cost-model cached-share|dynamo`, both `kv` mode) on
two workloads.

- trace: REQUESTS_PER_WINDOW requests of Mooncake's conversation trace, replayed as bench/tiers/run.py replays it
  (its mesh: 4 mocker workers, 4,096 device blocks of 64 tokens each, no host tier; its driver and clock, TIME_SCALE
  times faster than the trace). Repeat r replays window r (requests [r*N, (r+1)*N), clock restarted at its first).
- prefix: bench/routing/modes.py's shared-prefix workload (8 workers of 2,048 blocks, 64 x 2,048-token prefixes +
  256-token suffixes, Poisson arrivals at its rate), PREFIX_REQUESTS requests after its warm-up; repeat r draws
  its prompts and arrivals from seed r.

Each run gets a fresh mesh, its router seeded with the repeat's number. Figures per run: prefix reuse (the cached
share of prompt tokens as the workers report it), TTFT p50 and p99, load spread (the busiest worker's requests over
the mean). The table gives the median and [range] over the repeats, and dynamo/cached-share as the median [range] of
the ratios of paired runs (same window or seed). Dynamo "wins" a workload when its reuse ratio is >= 1 and its TTFT p99
ratio < 1; it would become the default only by winning both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
from bench.common.mesh_metrics import metrics_urls
from testkit import metrics
from testkit.mesh import launched, launched_mesh
from bench.common.report import bar_plot, median, median_range, percentile, save_json, table
from bench.routing import modes
from bench.tiers import run as tiers
from bench.tiers.mooncake_trace import TraceRequest, load
from services.mesh.discovery import ROUTER
from services.tools.make_demo_model import DemoModelSpec, ensure_demo_model

MODELS = ("cached-share", "dynamo")
REPEATS = 2
REQUESTS_PER_WINDOW = 300  # about 100 s of the trace: 20 s of arrivals at 5x
PREFIX_REQUESTS = 200  # 10 s of arrivals at 20 req/s
PREFIX_TIME_LIMIT_S = 60.0


@dataclass
class Run:
    workload: str
    model: str
    repeat: int
    reuse: float
    ttft_ms: list[float]
    failures: int
    per_worker: dict[str, int] = field(default_factory=dict)
    workers: int = 1

    @property
    def spread(self) -> float:
        counts = list(self.per_worker.values()) + [0] * (self.workers - len(self.per_worker))
        return max(counts) / (sum(counts) / self.workers) if sum(counts) else float("nan")

    def figures(self) -> dict[str, float]:
        return {"reuse": self.reuse, "ttft_p50_ms": percentile(self.ttft_ms, 50),
                "ttft_p99_ms": percentile(self.ttft_ms, 99), "spread": self.spread}


# -- the trace ------------------------------------------------------------------------------------


def trace_window(requests: Sequence[TraceRequest], repeat: int) -> list[TraceRequest]:
    window = requests[repeat * REQUESTS_PER_WINDOW:(repeat + 1) * REQUESTS_PER_WINDOW]
    start = window[0].timestamp_s
    return [dataclasses.replace(r, timestamp_s=r.timestamp_s - start) for r in window]


def routed_per_worker(urls: Sequence[str]) -> dict[str, int]:
    """The routers' kvmesh_router_routed_requests per worker."""
    out: Counter[str] = Counter()
    for url in urls:
        for sample in metrics.matching(metrics.scrape(url, timeout_s=5), "kvmesh_router_routed_requests_total"):
            out[sample.labels["worker_id"]] += int(sample.value)
    return dict(out)


def trace_run(model_dir: str, cost_model: str, repeat: int, requests: Sequence[TraceRequest]) -> Run:
    with launched_mesh("--engine", "mocker", "--timing", "large-gpu-8b", "--speedup", str(tiers.SPEEDUP),
                       "--decode-workers", str(tiers.WORKERS), "--prefill-workers", "0", "--num-gpu-blocks",
                       str(tiers.NUM_GPU_BLOCKS), "--block-size", str(tiers.BLOCK_SIZE), "--kv-bytes-per-token",
                       str(tiers.KV_BYTES_PER_TOKEN), "--model", model_dir, "--served-model-name", tiers.MODEL,
                       "--router-mode", "kv", "--cost-model", cost_model, "--seed", str(repeat)) as mesh:
        result = asyncio.run(tiers.drive(mesh.base, cost_model, requests))
        per_worker = routed_per_worker(metrics_urls(mesh, (ROUTER,)).get(ROUTER, []))
    return Run("trace", cost_model, repeat, result.reuse, result.ttft_ms, result.failures + result.not_sent,
               per_worker, tiers.WORKERS)


# -- shared prefixes ------------------------------------------------------------------------------


async def drive_prefixes(base: str, seed: int) -> modes.ModeResult:
    """modes.drive's workload from `seed`, PREFIX_REQUESTS of it, within PREFIX_TIME_LIMIT_S."""
    prefixes, rng = modes.prompts(seed)
    result = modes.ModeResult(mode="kv")
    limit = asyncio.Semaphore(modes.MAX_INFLIGHT)
    suffix: Callable[[], list[int]] = lambda: [rng.randrange(10, 1000) for _ in range(modes.SUFFIX_TOKENS)]
    async with aiohttp.ClientSession(base, timeout=aiohttp.ClientTimeout(total=PREFIX_TIME_LIMIT_S)) as session:
        for p in prefixes:  # warm-up: every prefix once, not counted
            await modes.one(session, p + suffix(), None)

        async def limited(tokens: list[int]) -> None:
            async with limit:
                try:
                    await modes.one(session, tokens, result)
                except (aiohttp.ClientError, TimeoutError):
                    result.failures += 1

        deadline = time.monotonic() + PREFIX_TIME_LIMIT_S
        tasks = []
        for _ in range(PREFIX_REQUESTS):
            if time.monotonic() > deadline:
                break
            tasks.append(asyncio.create_task(limited(rng.choice(prefixes) + suffix())))
            await asyncio.sleep(rng.expovariate(modes.RATE_PER_S))
        result.failures += PREFIX_REQUESTS - len(tasks)
        await asyncio.gather(*tasks)
    return result


def prefix_run(cost_model: str, repeat: int) -> Run:
    with launched("--engine", "mocker", "--decode-workers", str(modes.WORKERS), "--num-gpu-blocks",
                  str(modes.NUM_GPU_BLOCKS), "--router-mode", "kv", "--cost-model", cost_model,
                  "--seed", str(repeat)) as base:
        result = asyncio.run(drive_prefixes(base, seed=repeat))
    return Run("prefix", cost_model, repeat, result.hit_rate, result.ttft_ms, result.failures,
               dict(result.per_worker), modes.WORKERS)


# -- the comparison -------------------------------------------------------------------------------


def paired_ratios(runs: Sequence[Run], workload: str, figure: str) -> list[float]:
    by = {(r.model, r.repeat): r.figures()[figure] for r in runs if r.workload == workload}
    return [by["dynamo", i] / by["cached-share", i] for i in range(REPEATS)
            if ("cached-share", i) in by and ("dynamo", i) in by and by["cached-share", i]]


def dynamo_wins(runs: Sequence[Run], workload: str) -> bool:
    return (median(paired_ratios(runs, workload, "reuse")) >= 1.0
            and median(paired_ratios(runs, workload, "ttft_p99_ms")) < 1.0)


def run() -> dict:
    started = time.monotonic()
    model_dir = ensure_demo_model(tiers.MODEL_DIR, DemoModelSpec(max_context=tiers.MAX_INPUT_TOKENS))
    trace = load(limit=REPEATS * REQUESTS_PER_WINDOW, max_input_tokens=tiers.MAX_INPUT_TOKENS)
    runs: list[Run] = []
    for repeat in range(REPEATS):
        for cost_model in MODELS:  # cached-share and dynamo alternate, so a slow spell of the machine hits both
            print(f"cost models: trace window {repeat}, {cost_model} ...", flush=True)
            runs.append(trace_run(str(model_dir), cost_model, repeat, trace_window(trace, repeat)))
    for repeat in range(REPEATS):
        for cost_model in MODELS:
            print(f"cost models: shared prefixes seed {repeat}, {cost_model} ...", flush=True)
            runs.append(prefix_run(cost_model, repeat))
    rows = []
    for workload in ("trace", "prefix"):
        for cost_model in MODELS:
            mine = [r for r in runs if r.workload == workload and r.model == cost_model]
            figures = [r.figures() for r in mine]
            rows.append([workload, cost_model, " ".join(str(len(r.ttft_ms)) for r in mine),
                         sum(r.failures for r in mine),
                         median_range([100 * f["reuse"] for f in figures]) + " %",
                         median_range([f["ttft_p50_ms"] for f in figures], "{:.0f}"),
                         median_range([f["ttft_p99_ms"] for f in figures], "{:.0f}"),
                         median_range([f["spread"] for f in figures], "{:.2f}")])
        rows.append([workload, "dynamo/cached-share", "", "",
                     *(median_range(paired_ratios(runs, workload, f), "{:.2f}")
                       for f in ("reuse", "ttft_p50_ms", "ttft_p99_ms", "spread"))])
    wins = {w: dynamo_wins(runs, w) for w in ("trace", "prefix")}
    default = "dynamo" if all(wins.values()) else "cached-share"
    table(f"Cost models, kv mode, {REPEATS} repeats each (median [range]): trace = {REQUESTS_PER_WINDOW}-request "
          f"windows of Mooncake's conversation trace on {tiers.WORKERS} mocker workers at {tiers.TIME_SCALE:g}x; "
          f"prefix = {PREFIX_REQUESTS} shared-prefix requests on {modes.WORKERS} workers at {modes.RATE_PER_S:g} req/s",
          ["workload", "cost model", "done per run", "failed", "prefix reuse", "TTFT p50 ms", "TTFT p99 ms",
           "max/mean reqs"], rows)
    print(f"dynamo wins (reuse ratio >= 1 and TTFT p99 ratio < 1): {wins}; default kept: {default} "
          f"({time.monotonic() - started:.0f} s)", flush=True)
    labels = [f"{w} {m}" for w in ("trace", "prefix") for m in MODELS]
    cells = [[r.figures() for r in runs if f"{r.workload} {r.model}" == label] for label in labels]
    bar_plot("routing_cost_models", "Cached-share vs Dynamo cost model: TTFT (median of repeats, ms)", labels,
             {"p50": [median([f["ttft_p50_ms"] for f in c]) for c in cells],
              "p99": [median([f["ttft_p99_ms"] for f in c]) for c in cells]}, "ms")
    data = {"repeats": REPEATS, "trace_requests_per_window": REQUESTS_PER_WINDOW, "prefix_requests": PREFIX_REQUESTS,
            "runs": [{"workload": r.workload, "model": r.model, "repeat": r.repeat, "done": len(r.ttft_ms),
                      "failures": r.failures, "per_worker": r.per_worker, **r.figures()} for r in runs],
            "ratios_dynamo_over_cached_share": {w: {f: paired_ratios(runs, w, f)
                                                    for f in ("reuse", "ttft_p50_ms", "ttft_p99_ms", "spread")}
                                                for w in ("trace", "prefix")},
            "dynamo_wins": wins, "default": default}
    save_json("routing_cost_models", data)
    return data

