"""Step-paced streams on one worker: does the mesh keep the engine's pace? (Part of
`make bench ARGS="--only hot-path"`; alone: `--only one-worker`.)

One mocker decode worker steps every 20 ms and makes one token per running sequence per step, so
N sequences ideally get N x 50 tokens/s each 20 ms apart. Configurations (issue 28's A to D):
A, 512 streamed completions x 200 tokens; B, 1,024 and 2,048 x 100; C, 4,096 x 50 through 1 and
through 2 gateways (frontends sharing the port); D, 512 streamed chat completions x 200 tokens, a
mix by stream number: 10% with stop strings, 10% with logprobs, 5% through the tool parser
(hermes), 5% with n=2, the rest plain (the processor's and gateway's fast lane). Each runs three
times on one mesh; tables give the median and, in brackets, the lowest and highest run.

Per run: delivered tokens/s over ideal; the gaps a client sees between arrivals (ITL p50, p99,
p99.9; events read in one socket read count as one arrival) after every stream has its first
token (for 4,096 streams, after each stream's own first token: their ramp-up outlasts a
stream); the worst stream's largest gap over its median gap; TTFT p50 and p99; CPU µs and
context switches per token of each mesh process (from /proc), and of the load generator apart;
what each hop adds (`kvmesh_hop_latency_seconds`, p50 and p99, from each process's /metrics)
and its garbage-collector pauses (`kvmesh_gc_pause_seconds`); for D, the ITL of each part of the
mix apart.

The load generator is lean (lean_client.py: raw HTTP, no JSON per event), so less of the 2-core
machine goes to measuring.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from dataclasses import dataclass, field

from bench.common.mesh_metrics import Buckets, delta, histogram, metrics_urls, quantile
from testkit.mesh import LaunchedMesh, launched_mesh
from testkit.proc_stat import context_switches
from bench.common.report import bar_plot, median_range, percentile, save_json, table
from bench.hot_path.lean_client import LeanStream, arrival_gaps, chat, completion, lean_stream
from bench.hot_path.stream_load import PROMPT

STEP_S = 0.020
STEP_MS = STEP_S * 1000
NAN = float("nan")
REPEATS = 3
# (name, streams, tokens per stream, frontends, mix)
CONFIGS = (("A", 512, 200, 1, False), ("B", 1024, 100, 1, False), ("B", 2048, 100, 1, False),
           ("C", 4096, 50, 1, False), ("C", 4096, 50, 2, False), ("D", 512, 200, 1, True))
MODEL = "kvmesh-demo"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
FAST_LANE = "plain"
# D's mix by stream number modulo 20: (part, extra request fields, choices per stream).
MIX = (2 * [("stop strings", {"stop": ["<<not in any text>>"]}, 1)]
       + 2 * [("logprobs", {"logprobs": True, "top_logprobs": 2}, 1)]
       + [("tool parser", {"tools": [WEATHER]}, 1)] + [("n=2", {"n": 2}, 2)] + 14 * [(FAST_LANE, {}, 1)])
PROCESSES = ("frontend", "processor", "decode-worker", "kv-router")
# From this many streams the ramp-up outlasts a stream: ITL counts each stream's own gaps.
OWN_GAPS_FROM = 4096
HOPS = ("decode_worker", "processor", "frontend")
STREAM_TIMEOUT_S = 300.0


@dataclass
class Run:
    # Streams refused or broken (the rest are measured; ideal is counted for them alone).
    failed: int
    of_ideal: float
    itl_ms: tuple[float, float, float]  # p50, p99, p99.9
    worst: float
    ttft_ms: tuple[float, float]
    cpu_us: dict[str, float]  # per token, per process name, "client" apart
    switches: dict[str, float]  # per 1,000 tokens
    hop_ms: dict[str, tuple[float, float]]  # p50, p99
    parts: dict[str, tuple[float, float]]  # D: ITL p50, p99 ms by part of the mix
    # Per process name: GC pauses per 1,000 tokens, full (generation 2) collections, p99 pause ms.
    gc: dict[str, tuple[float, float, float]] = field(default_factory=dict)


@dataclass
class Config:
    name: str
    streams: int
    tokens: int
    frontends: int
    mix: bool = False
    runs: list[Run] = field(default_factory=list)

    def requests(self) -> list[tuple[str, tuple[str, dict], int]]:
        """Per stream: its part of the mix, its request, its choices."""
        if not self.mix:
            return [(FAST_LANE, completion(MODEL, f"{i} {PROMPT}", self.tokens), 1) for i in range(self.streams)]
        return [(part, chat(MODEL, f"{i} {PROMPT}", self.tokens, **extra), n)
                for i in range(self.streams) for part, extra, n in [MIX[i % len(MIX)]]]


@dataclass
class Summary:
    of_ideal: float
    itl_ms: tuple[float, float, float]  # p50, p99, p99.9
    worst: float  # the worst stream's largest gap over its median gap
    ttft_ms: tuple[float, float]  # p50, p99
    parts: dict[str, tuple[float, float]]  # ITL p50, p99 ms by part of the mix


def _summarise(results: list[tuple[str, LeanStream, int]], tokens: int) -> Summary:
    """`results`: (part of the mix, stream, choices) of each stream that completed."""
    sequences = sum(n for _, _, n in results)
    delivered = sum(r.completion_tokens for _, r, _ in results)
    if delivered != sequences * tokens or not all(r.arrivals for _, r, _ in results):
        raise RuntimeError(f"expected {sequences * tokens} tokens in events, usage says {delivered}")
    firsts = [r.arrivals[0] for _, r, _ in results]
    steady = max(firsts) if len(results) < OWN_GAPS_FROM else 0.0
    gaps: dict[str, list[float]] = {}
    worst = 0.0
    for part, r, n in results:
        own = arrival_gaps(r.arrivals, max(steady, r.arrivals[0]), n)
        if len(own) >= 2:
            gaps.setdefault(part, []).extend(own)
            if n == 1:  # a worst stream of one choice: several choices' gaps are coarser
                worst = max(worst, max(own) / max(statistics.median(own), 1e-3))
    # The tokens after the first arrival anywhere, over the time from it to the last anywhere
    # (late starters and stragglers lower it, as they lower what users get); each sequence's first
    # token is left out, having come at or after the clock's start.
    rate = (delivered - sequences) / (max(r.arrivals[-1] for _, r, _ in results) - min(firsts))
    ttfts = [(r.arrivals[0] - r.started) * 1000 for _, r, _ in results]
    every = [gap for part_gaps in gaps.values() for gap in part_gaps]
    return Summary(rate * STEP_S / sequences, (percentile(every, 50), percentile(every, 99), percentile(every, 99.9)),
                   worst, (percentile(ttfts, 50), percentile(ttfts, 99)),
                   {part: (percentile(g, 50), percentile(g, 99)) for part, g in gaps.items()})


@dataclass
class Probe:
    """What the mesh's processes had done at one moment (a run is the difference of two)."""

    cpu: dict[str, float]  # seconds per process name, and this client's
    switches: dict[str, int]
    hops: dict[str, Buckets]  # per process name, by hop
    gc: dict[str, Buckets]  # per process name, by generation


def _probe(mesh: LaunchedMesh, urls: dict[str, list[str]]) -> Probe:
    return Probe({**mesh.cpu_by_component(), "client": time.process_time()},
                 {name: sum(context_switches(pid) for pid in mesh.pids(name)) for name in PROCESSES},
                 {name: histogram(u, "kvmesh_hop_latency_seconds", "hop") for name, u in urls.items()},
                 {name: histogram(u, "kvmesh_gc_pause_seconds", "generation") for name, u in urls.items()})


def _gc_figures(after: Buckets, before: Buckets, tokens: int) -> tuple[float, float, float]:
    """(pauses per 1,000 tokens, full collections, p99 pause ms) between two probes."""
    by_generation = delta(after, before)
    merged: dict[float, float] = {}
    for buckets in by_generation.values():
        for le, count in buckets.items():
            merged[le] = merged.get(le, 0.0) + count
    pauses = merged.get(math.inf, 0.0)
    return pauses / tokens * 1000, by_generation.get("2", {}).get(math.inf, 0.0), quantile(merged, 0.99) * 1000


async def _load(base: str, requests: list[tuple[str, tuple[str, dict], int]]
                ) -> tuple[list[tuple[str, LeanStream, int]], list[BaseException]]:
    """The streams that completed (part, stream, choices), and why the others did not (a mesh
    past its knee refuses some)."""
    done = await asyncio.gather(*(lean_stream(base, request, STREAM_TIMEOUT_S) for _, request, _ in requests),
                                return_exceptions=True)
    failures = [r for r in done if isinstance(r, BaseException)]
    if len(failures) == len(requests):
        raise RuntimeError(f"every stream failed, e.g. {failures[0]}")
    return [(part, r, n) for (part, _, n), r in zip(requests, done) if isinstance(r, LeanStream)], failures


def _one_run(mesh: LaunchedMesh, urls: dict[str, list[str]], config: Config) -> Run:
    before = _probe(mesh, urls)
    results, failures = asyncio.run(_load(mesh.base, config.requests()))
    after = _probe(mesh, urls)
    if failures:
        print(f"  {len(failures)} of {config.streams} streams failed, e.g. {str(failures[0])[:300]}", flush=True)
    total = sum(r.completion_tokens for _, r, _ in results)
    summary = _summarise(results, config.tokens)
    hop_ms: dict[str, tuple[float, float]] = {}
    for name in urls:
        for hop, buckets in delta(after.hops[name], before.hops.get(name, {})).items():
            hop_ms[hop] = (quantile(buckets, 0.5) * 1000, quantile(buckets, 0.99) * 1000)
    return Run(len(failures), summary.of_ideal, summary.itl_ms, summary.worst, summary.ttft_ms,
               {k: (after.cpu[k] - before.cpu.get(k, 0.0)) / total * 1e6 for k in after.cpu},
               {k: (after.switches[k] - before.switches[k]) / total * 1000 for k in after.switches}, hop_ms,
               summary.parts if config.mix else {},
               {name: _gc_figures(after.gc[name], before.gc.get(name, {}), total) for name in urls})


def measure(config: Config) -> None:
    print(f"hot path, one worker: {config.streams} streams x {config.tokens} tokens, {config.frontends} "
          f"frontend(s), {REPEATS} runs ...", flush=True)
    sequences = sum(n for _, _, n in config.requests())
    with launched_mesh("--engine", "mocker", "--timing", "fixed-step-20ms", "--decode-workers", "1",
                       "--max-num-seqs", str(sequences), "--num-gpu-blocks", "65536",
                       "--frontends", str(config.frontends), "--max-inflight", str(2 * config.streams),
                       *(("--tool-call-parser", "hermes") if config.mix else ()), timeout_s=300) as mesh:
        # Warm-up: connections, sessions, tokenizer (raises if it fails).
        asyncio.run(_load(mesh.base, [(FAST_LANE, completion(MODEL, PROMPT, 4), 1)]))
        # Frontends sharing one port answer /metrics in turn: a hop figure summed over them is
        # not to be had from outside, so the frontend hop is left out with several.
        watched = ("frontend", "processor", "decode-worker") if config.frontends == 1 else ("processor", "decode-worker")
        urls = metrics_urls(mesh, watched)
        for _ in range(REPEATS):
            config.runs.append(_one_run(mesh, urls, config))


def label(c: Config) -> str:
    return f"{c.name}: {c.streams} x {c.tokens}, {c.frontends} gw{', mix' if c.mix else ''}"


def report(configs: list[Config]) -> dict:
    table(f"Streams on one mocker worker stepping every {STEP_MS:.0f} ms (kvmesh; median [lowest-highest] of "
          f"{REPEATS} runs; ideal = streams x 50 tokens/s)",
          ["config", "failed", "of ideal", "ITL p50 ms", "ITL p99 ms", "ITL p99.9 ms", "worst max/median", "TTFT p50 ms",
           "TTFT p99 ms"],
          [[label(c), sum(r.failed for r in c.runs), median_range([r.of_ideal for r in c.runs], "{:.2f}"),
            median_range([r.itl_ms[0] for r in c.runs], "{:.1f}"),
            median_range([r.itl_ms[1] for r in c.runs], "{:.0f}"), median_range([r.itl_ms[2] for r in c.runs], "{:.0f}"),
            median_range([r.worst for r in c.runs], "{:.1f}"), median_range([r.ttft_ms[0] for r in c.runs], "{:.0f}"),
            median_range([r.ttft_ms[1] for r in c.runs], "{:.0f}")] for c in configs])
    table("CPU µs per token by process (median of the runs; the load generator apart), and context switches "
          "per 1,000 tokens",
          ["config", "mesh", *PROCESSES, "client", *(f"cs {p}" for p in PROCESSES)],
          [[label(c), median_range([sum(r.cpu_us.get(p, 0.0) for p in PROCESSES) for r in c.runs], "{:.1f}"),
            *(statistics.median(r.cpu_us.get(p, NAN) for r in c.runs) for p in PROCESSES),
            statistics.median(r.cpu_us["client"] for r in c.runs),
            *(statistics.median(r.switches.get(p, NAN) for r in c.runs) for p in PROCESSES)]
           for c in configs])
    table("What each hop adds to a token's latency (kvmesh_hop_latency_seconds; ms, p50 / p99, median of the runs)",
          ["config", *HOPS],
          [[label(c), *(f"{statistics.median(r.hop_ms.get(h, (NAN, NAN))[0] for r in c.runs):.2f} / "
                        f"{statistics.median(r.hop_ms.get(h, (NAN, NAN))[1] for r in c.runs):.1f}" for h in HOPS)]
           for c in configs])
    gc_processes = [p for p in PROCESSES if any(p in r.gc for c in configs for r in c.runs)]
    table("Garbage-collector pauses by process: per 1,000 tokens / full collections / p99 ms (median of the runs)",
          ["config", *gc_processes],
          [[label(c), *(" / ".join(f"{statistics.median(r.gc.get(p, (NAN, NAN, NAN))[i] for r in c.runs):{fmt}}"
                                   for i, fmt in enumerate((".2f", ".0f", ".1f"))) for p in gc_processes)]
           for c in configs])
    mixed = [c for c in configs if c.mix]
    parts = sorted({part for c in mixed for r in c.runs for part in r.parts}, key=lambda p: p != FAST_LANE)
    if mixed:
        table("The mix's parts: ITL ms, p50 / p99 (median of the runs)", ["config", *parts],
              [[label(c), *(f"{statistics.median(r.parts.get(p, (NAN, NAN))[0] for r in c.runs):.1f} / "
                            f"{statistics.median(r.parts.get(p, (NAN, NAN))[1] for r in c.runs):.0f}" for p in parts)]
               for c in mixed])
    bar_plot("hot_path_one_worker", f"Delivered / ideal, streams on one worker ({STEP_MS:.0f} ms step)",
             [label(c) for c in configs], {"kvmesh": [statistics.median(r.of_ideal for r in c.runs) for c in configs]},
             "of ideal")
    result = {label(c): [r.__dict__ for r in c.runs] for c in configs}
    save_json("hot_path_one_worker", result)
    return result


def run() -> dict:
    configs = [Config(*config) for config in CONFIGS]
    for config in configs:
        measure(config)
    return report(configs)
