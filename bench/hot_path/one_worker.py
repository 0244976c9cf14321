"""Step-paced streams on one worker: does the mesh keep the engine's pace? (Part of
`make bench ARGS="--only hot-path"`; alone: `--only one-worker`.)

One mocker decode worker steps every 20 ms and makes one token per running stream per step, so
N streams ideally get N x 50 tokens/s each 20 ms apart. Configurations (issue 28's A, B and C):
512 streams x 200 tokens; 1,024 and 2,048 x 100; 4,096 x 50 through 1 and through 2 gateways
(frontends sharing the port). Each runs three times on one mesh; tables give the median and, in
brackets, the lowest and highest run.

Per run: delivered tokens/s over ideal; the gaps a client sees between arrivals (ITL p50, p99,
p99.9; events read in one socket read count as one arrival) after every stream has its first
token (for 4,096 streams, after each stream's own first token: their ramp-up outlasts a
stream); the worst stream's largest gap over its median gap; TTFT p50 and p99; CPU µs and
context switches per token of each mesh process (from /proc), and of the load generator apart;
what each hop adds (`kvmesh_hop_latency_seconds`, p50 and p99, from each process's /metrics).

The load generator is lean (lean_client.py: raw HTTP, no JSON per event), so less of the 2-core
machine goes to measuring.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field

from bench.common.mesh_metrics import Buckets, delta, histogram, metrics_urls, quantile
from bench.common.mesh_process import LaunchedMesh, launched_mesh
from bench.common.proc_stat import context_switches
from bench.common.report import bar_plot, percentile, save_json, table
from bench.hot_path.lean_client import LeanStream, lean_stream
from bench.hot_path.stream_load import PROMPT

STEP_S = 0.020
STEP_MS = STEP_S * 1000
NAN = float("nan")
REPEATS = 3
# (name, streams, tokens per stream, frontends)
CONFIGS = (("A", 512, 200, 1), ("B", 1024, 100, 1), ("B", 2048, 100, 1), ("C", 4096, 50, 1), ("C", 4096, 50, 2))
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


@dataclass
class Config:
    name: str
    streams: int
    tokens: int
    frontends: int
    runs: list[Run] = field(default_factory=list)


def _arrival_gaps(arrivals: list[float], since: float) -> list[float]:
    """Gaps in ms between distinct arrivals (events read together arrive together) from `since`."""
    times = sorted({t for t in arrivals if t >= since})
    return [(b - a) * 1000 for a, b in zip(times, times[1:])]


def _summarise(results: list[LeanStream], streams: int,
               tokens: int) -> tuple[float, tuple[float, float, float], float, tuple[float, float]]:
    """(of ideal, ITL p50/p99/p99.9 ms, worst stream max/median, TTFT p50/p99 ms)."""
    delivered = sum(r.completion_tokens for r in results)
    if delivered != streams * tokens or not all(r.arrivals for r in results):
        raise RuntimeError(f"expected {streams * tokens} tokens in events, usage says {delivered}")
    firsts = [r.arrivals[0] for r in results]
    steady = max(firsts) if streams < OWN_GAPS_FROM else 0.0
    gaps: list[float] = []
    worst = 0.0
    for r in results:
        own = _arrival_gaps(r.arrivals, max(steady, r.arrivals[0]))
        if len(own) >= 2:
            gaps += own
            worst = max(worst, max(own) / max(statistics.median(own), 1e-3))
    # The tokens after the first arrival anywhere, over the time from it to the last anywhere
    # (late starters and stragglers lower it, as they lower what users get); each stream's first
    # token is left out, having come at or after the clock's start.
    rate = (delivered - streams) / (max(r.arrivals[-1] for r in results) - min(firsts))
    ttfts = [(r.arrivals[0] - r.started) * 1000 for r in results]
    itl = (percentile(gaps, 50), percentile(gaps, 99), percentile(gaps, 99.9))
    return rate * STEP_S / streams, itl, worst, (percentile(ttfts, 50), percentile(ttfts, 99))


def _probe(mesh: LaunchedMesh, urls: dict[str, list[str]]) -> tuple[dict[str, float], dict[str, int],
                                                                    dict[str, Buckets]]:
    """CPU seconds per process name (and this client's), context switches, hop histograms."""
    cpu = {**mesh.cpu_by_component(), "client": time.process_time()}
    switches = {name: sum(context_switches(pid) for pid in mesh.pids(name)) for name in PROCESSES}
    hops = {name: histogram(u, "kvmesh_hop_latency_seconds", "hop") for name, u in urls.items()}
    return cpu, switches, hops


async def _load(base: str, streams: int, tokens: int) -> tuple[list[LeanStream], list[BaseException]]:
    """The streams that completed, and why the others did not (a mesh past its knee refuses some)."""
    done = await asyncio.gather(*(lean_stream(base, "kvmesh-demo", f"{i} {PROMPT}", tokens, STREAM_TIMEOUT_S)
                                  for i in range(streams)), return_exceptions=True)
    failures = [r for r in done if isinstance(r, BaseException)]
    if len(failures) == streams:
        raise RuntimeError(f"every stream failed, e.g. {failures[0]}")
    return [r for r in done if isinstance(r, LeanStream)], failures


def _one_run(mesh: LaunchedMesh, urls: dict[str, list[str]], config: Config) -> Run:
    cpu0, sw0, hops0 = _probe(mesh, urls)
    results, failures = asyncio.run(_load(mesh.base, config.streams, config.tokens))
    cpu1, sw1, hops1 = _probe(mesh, urls)
    if failures:
        print(f"  {len(failures)} of {config.streams} streams failed, e.g. {str(failures[0])[:300]}", flush=True)
    total = len(results) * config.tokens
    of_ideal, itl, worst, ttft = _summarise(results, len(results), config.tokens)
    hop_ms: dict[str, tuple[float, float]] = {}
    for name in urls:
        for hop, buckets in delta(hops1[name], hops0.get(name, {})).items():
            hop_ms[hop] = (quantile(buckets, 0.5) * 1000, quantile(buckets, 0.99) * 1000)
    return Run(len(failures), of_ideal, itl, worst, ttft, {k: (cpu1[k] - cpu0.get(k, 0.0)) / total * 1e6 for k in cpu1},
               {k: (sw1[k] - sw0[k]) / total * 1000 for k in sw1}, hop_ms)


def measure(config: Config) -> None:
    print(f"hot path, one worker: {config.streams} streams x {config.tokens} tokens, {config.frontends} "
          f"frontend(s), {REPEATS} runs ...", flush=True)
    with launched_mesh("--engine", "mocker", "--timing", "fixed-step-20ms", "--decode-workers", "1",
                       "--max-num-seqs", str(config.streams), "--num-gpu-blocks", "65536",
                       "--frontends", str(config.frontends), "--max-inflight", str(2 * config.streams),
                       timeout_s=300) as mesh:
        asyncio.run(_load(mesh.base, 1, 4))  # warm-up: connections, sessions, tokenizer (raises if it fails)
        # Frontends sharing one port answer /metrics in turn: a hop figure summed over them is
        # not to be had from outside, so the frontend hop is left out with several.
        watched = ("frontend", "processor", "decode-worker") if config.frontends == 1 else ("processor", "decode-worker")
        urls = metrics_urls(mesh, watched)
        for _ in range(REPEATS):
            config.runs.append(_one_run(mesh, urls, config))


def _med(values: list[float], fmt: str = "{:.2f}") -> str:
    """The median, and the lowest and highest run in brackets."""
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def label(c: Config) -> str:
    return f"{c.name}: {c.streams} x {c.tokens}, {c.frontends} gw"


def report(configs: list[Config]) -> dict:
    table(f"Streams on one mocker worker stepping every {STEP_MS:.0f} ms (kvmesh; median [lowest-highest] of "
          f"{REPEATS} runs; ideal = streams x 50 tokens/s)",
          ["config", "failed", "of ideal", "ITL p50 ms", "ITL p99 ms", "ITL p99.9 ms", "worst max/median", "TTFT p50 ms",
           "TTFT p99 ms"],
          [[label(c), sum(r.failed for r in c.runs), _med([r.of_ideal for r in c.runs]),
            _med([r.itl_ms[0] for r in c.runs], "{:.1f}"),
            _med([r.itl_ms[1] for r in c.runs], "{:.0f}"), _med([r.itl_ms[2] for r in c.runs], "{:.0f}"),
            _med([r.worst for r in c.runs], "{:.1f}"), _med([r.ttft_ms[0] for r in c.runs], "{:.0f}"),
            _med([r.ttft_ms[1] for r in c.runs], "{:.0f}")] for c in configs])
    table("CPU µs per token by process (median of the runs; the load generator apart), and context switches "
          "per 1,000 tokens",
          ["config", "mesh", *PROCESSES, "client", *(f"cs {p}" for p in PROCESSES)],
          [[label(c), _med([sum(r.cpu_us.get(p, 0.0) for p in PROCESSES) for r in c.runs], "{:.1f}"),
            *(statistics.median(r.cpu_us.get(p, NAN) for r in c.runs) for p in PROCESSES),
            statistics.median(r.cpu_us["client"] for r in c.runs),
            *(statistics.median(r.switches.get(p, NAN) for r in c.runs) for p in PROCESSES)]
           for c in configs])
    table("What each hop adds to a token's latency (kvmesh_hop_latency_seconds; ms, p50 / p99, median of the runs)",
          ["config", *HOPS],
          [[label(c), *(f"{statistics.median(r.hop_ms.get(h, (NAN, NAN))[0] for r in c.runs):.2f} / "
                        f"{statistics.median(r.hop_ms.get(h, (NAN, NAN))[1] for r in c.runs):.1f}" for h in HOPS)]
           for c in configs])
    bar_plot("hot_path_one_worker", f"Delivered / ideal, streams on one worker ({STEP_MS:.0f} ms step)",
             [label(c) for c in configs], {"kvmesh": [statistics.median(r.of_ideal for r in c.runs) for c in configs]},
             "of ideal")
    result = {label(c): [r.__dict__ for r in c.runs] for c in configs}
    save_json("hot_path_one_worker", result)
    return result


def run() -> dict:
    configs = [Config(name, streams, tokens, frontends) for name, streams, tokens, frontends in CONFIGS]
    for config in configs:
        measure(config)
    return report(configs)
