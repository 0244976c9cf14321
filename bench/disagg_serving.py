"""Disaggregated vs aggregated serving on the mocker, at rising request rates.

Both sides have 4 workers: aggregated = 4 decode workers; disaggregated = 3 prefill + 1 decode
(remote prefill above 512 uncached tokens, prefill queue limit 8) — the split that matches this
prefill-heavy mix, as one sizes the pools for a workload. The mocker imitates a large
GPU serving an 8B model (`--timing large-gpu-8b`: ~20 us per prefill token, an 8k prompt in
~250 ms, an 8 ms decode step) and moves 8 KiB of synthetic KV per prompt token over NIXL between
its processes (a real 8B model holds ~128 KiB per token; the transfer is real, its size scaled
down to this machine). Workload: Poisson arrivals, half long prompts (8192 tokens), half short
(256 tokens), 32 output tokens each. (With a rarer long prompt the prefill stalls stay under 1%
of the decode steps, invisible to an ITL p99, until request rates this 2-core machine cannot
drive through Python.) SLOs: TTFT <= 500 ms, ITL <= 50 ms; goodput counts requests
meeting both (TTFT, and their mean ITL). The demo model is rebuilt with a 16k context for the
8k prompts (the mocker needs only its config and tokenizer).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import aiohttp

from pathlib import Path

from testkit.mesh import launched
from testkit.sse import Streamed, stream_completion
from bench.common.report import percentile, save_json, table
from services.tools.make_demo_model import DemoModelSpec, ensure_demo_model

RATES = (4.0, 8.0, 12.0, 16.0, 20.0, 24.0)
SECONDS_PER_RATE = 12.0
LONG, SHORT, LONG_SHARE, OUTPUT = 8192, 256, 0.5, 32
TTFT_SLO_S, ITL_SLO_S = 0.5, 0.05
MAX_INFLIGHT = 512
COMMON = ("--engine", "mocker", "--timing", "large-gpu-8b", "--num-gpu-blocks", "16384",
          "--served-model-name", "kvmesh-demo")
LONG_CONTEXT_MODEL = Path(".cache/models/kvmesh-demo-16k")
MODES = {
    "aggregated": ("--decode-workers", "4", "--prefill-workers", "0"),
    "disaggregated": ("--decode-workers", "1", "--prefill-workers", "3", "--max-local-prefill-length", "512",
                      "--max-prefill-queue-size", "8"),
}


@dataclass
class Point:
    mode: str
    rate: float
    seconds: float = 0.0
    results: list[tuple[bool, Streamed]] = field(default_factory=list)  # (is_long, result)

    def short_gaps(self) -> list[float]:
        return [g for long, r in self.results if not long and r.ok for g in r.gaps_s]

    def ttfts(self) -> list[float]:
        return [r.ttft_s for _, r in self.results if r.ok]

    def goodput(self) -> float:
        good = sum(1 for _, r in self.results if r.ok and r.ttft_s <= TTFT_SLO_S and r.mean_itl_s <= ITL_SLO_S)
        return good / self.seconds if self.seconds else 0.0

    def failed(self) -> int:
        return sum(1 for _, r in self.results if not r.ok)


async def drive(base: str, mode: str, rate: float, seed: int) -> Point:
    rng = random.Random(seed)
    point = Point(mode, rate)
    limit = asyncio.Semaphore(MAX_INFLIGHT)
    async with aiohttp.ClientSession(base, timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def one(long: bool) -> None:
            tokens = [rng.randrange(20, 1000) for _ in range(LONG if long else SHORT)]
            async with limit:
                point.results.append((long, await stream_completion(session, tokens, OUTPUT)))

        tasks = []
        started = time.perf_counter()
        while time.perf_counter() - started < SECONDS_PER_RATE:
            tasks.append(asyncio.create_task(one(rng.random() < LONG_SHARE)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.wait_for(asyncio.gather(*tasks), 180)
        point.seconds = time.perf_counter() - started
    return point


def max_rate_within_itl_slo(points: list[Point]) -> float:
    ok = [p.rate for p in points if percentile(p.short_gaps(), 99) <= ITL_SLO_S and not p.failed()]
    return max(ok, default=0.0)


def run() -> dict:
    model = ensure_demo_model(LONG_CONTEXT_MODEL, DemoModelSpec(max_context=16384))
    points: dict[str, list[Point]] = {}
    for mode, flags in MODES.items():
        print(f"disaggregation: {mode} ...", flush=True)
        with launched(*COMMON, "--model", str(model), *flags) as base:
            points[mode] = [asyncio.run(drive(base, mode, rate, seed=int(rate * 10))) for rate in RATES]
    rows = []
    for rate_index, rate in enumerate(RATES):
        for mode in MODES:
            p = points[mode][rate_index]
            gaps, ttfts = p.short_gaps(), p.ttfts()
            rows.append([f"{rate:g}", mode, len(p.results), p.failed(), percentile(ttfts, 50) * 1000,
                         percentile(ttfts, 99) * 1000, percentile(gaps, 50) * 1000, percentile(gaps, 99) * 1000,
                         p.goodput()])
    table("Disaggregated (3 prefill + 1 decode) vs aggregated (4) on the mocker, large-GPU timing, "
          f"{LONG_SHARE:.0%} x {LONG}-token + {1 - LONG_SHARE:.0%} x {SHORT}-token prompts",
          ["req/s", "mode", "requests", "failed", "TTFT p50 ms", "TTFT p99 ms", "short ITL p50 ms",
           "short ITL p99 ms", "goodput req/s"], rows)
    agg, dis = max_rate_within_itl_slo(points["aggregated"]), max_rate_within_itl_slo(points["disaggregated"])
    ratio = dis / agg if agg else float("inf")
    print(f"highest rate with short-request ITL p99 <= {ITL_SLO_S * 1000:.0f} ms: aggregated {agg:g} req/s, "
          f"disaggregated {dis:g} req/s (x{ratio:.2f}; goal >= x1.5)", flush=True)
    _plot(points)
    data = {mode: [{"rate": p.rate, "requests": len(p.results), "failed": p.failed(),
                    "ttft_p50_ms": percentile(p.ttfts(), 50) * 1000, "ttft_p99_ms": percentile(p.ttfts(), 99) * 1000,
                    "itl_p50_ms": percentile(p.short_gaps(), 50) * 1000,
                    "itl_p99_ms": percentile(p.short_gaps(), 99) * 1000, "goodput": p.goodput()} for p in pts]
            for mode, pts in points.items()}
    data["max_rate_within_itl_slo"] = {"aggregated": agg, "disaggregated": dis}
    save_json("disagg_serving", data)
    return data


def _plot(points: dict[str, list[Point]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.common.report import save_figure

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for mode, pts in points.items():
        rates = [p.rate for p in pts]
        axes[0].plot(rates, [percentile(p.short_gaps(), 99) * 1000 for p in pts], marker="o", label=mode)
        axes[1].plot(rates, [percentile(p.ttfts(), 99) * 1000 for p in pts], marker="o", label=mode)
        axes[2].plot(rates, [p.goodput() for p in pts], marker="o", label=mode)
    axes[0].axhline(ITL_SLO_S * 1000, color="grey", linestyle="--")
    axes[1].axhline(TTFT_SLO_S * 1000, color="grey", linestyle="--")
    for ax, title in zip(axes, ["short-request ITL p99 (ms)", "TTFT p99 (ms)", "goodput (req/s)"]):
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(title)
        ax.legend()
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    save_figure(fig, "disagg_serving")
