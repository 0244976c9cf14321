"""The hot path against NVIDIA Dynamo: streamed tokens/s and 1-token requests/s through one
frontend, one processor (Dynamo: its frontend, which tokenizes itself) and one zero-compute mocker
worker, both systems on this machine in the same run.

Measures (the issue's table), for each layout of the mesh (the kv-router service; the processor
routing in-process; a gateway hosting its processor and routing in-process; two such gateways
sharing the port) and for Dynamo, in
REPEATS rounds (each round every layout, then Dynamo), as median [lowest-highest]:
- streamed output tokens/s, 64 concurrent streams of 128 tokens (rounds of 64, best of 3);
- 1-token completions/s at concurrency 64 and 16, and p50 latency at concurrency 1;
- CPU per 1-token request and per streamed token of the served processes (etcd excluded);
- where a request's and a token's CPU go, by process and step (request_profile.py);
- streams on one mocker worker stepping every 20 ms, 512 to 4,096 of them (one_worker.py): how
  close to the engine's pace the mesh keeps them, and what each process and hop adds;
- what a token and a request cost in CPU across the mesh's processes (to size a cluster), and
  how 2 frontends (one port, SO_REUSEPORT) and 2 processors share the load.
Dynamo is installed into its own venv on first use (bench/hot_path/dynamo.py); where that is
impossible its column says why and kvmesh's figures still print.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import aiohttp

from bench.hot_path import dynamo, one_worker, request_profile
from bench.mesh_overhead import Level, drive
from bench.hot_path.scale import run_scale
from testkit.mesh import launched_mesh
from testkit.proc_stat import cpu_seconds
from bench.hot_path.stream_load import one_stream, one_token_completion
from bench.common.report import bar_plot, median_range, save_json, table
from services.tools.make_demo_model import ensure_demo_model

STREAMS, STREAM_TOKENS, STREAM_ROUNDS = 64, 128, 3
RPS_LEVELS = {64: 3000, 16: 2000, 1: 300}
LEVEL_TIME_LIMIT_S = 30.0


@dataclass
class Figures:
    tokens_per_s: float = float("nan")
    rps: dict[int, float] = field(default_factory=dict)
    p50_ms: dict[int, float] = field(default_factory=dict)
    # CPU microseconds of the mesh's processes (etcd excluded) per streamed token / per request.
    cpu_us_per_token: float = float("nan")
    cpu_us_per_request: float = float("nan")
    # The load generator's own CPU (this process), reported apart from the mesh's.
    client_cpu_us_per_token: float = float("nan")
    client_cpu_us_per_request: float = float("nan")
    note: str = ""


@dataclass
class Replicas:
    tokens_per_s: float
    rps: float
    # max / mean CPU used over the replicas of each component.
    frontend_spread: float
    processor_spread: float


async def streamed_tokens_per_s(base: str, model: str) -> float:
    best = 0.0
    async with aiohttp.ClientSession(base, connector=aiohttp.TCPConnector(limit=STREAMS * 2)) as session:
        await one_stream(session, model, 8)  # warm-up
        for _ in range(STREAM_ROUNDS):
            started = time.perf_counter()
            results = await asyncio.gather(*(one_stream(session, model, STREAM_TOKENS) for _ in range(STREAMS)))
            elapsed = time.perf_counter() - started
            total = sum(tokens for tokens, _, _ in results)
            if total != STREAMS * STREAM_TOKENS:
                raise RuntimeError(f"expected {STREAMS * STREAM_TOKENS} tokens, usage says {total}")
            best = max(best, total / elapsed)
    return best


WARM_UP_REQUESTS = 50


async def one_token_levels(base: str, model: str, levels: dict[int, int],
                           warm_up: int = WARM_UP_REQUESTS) -> dict[int, Level]:
    """1-token completions: `warm_up` one by one, then for each concurrency its count of requests."""
    async with aiohttp.ClientSession(base, connector=aiohttp.TCPConnector(limit=256)) as session:
        one = partial(one_token_completion, session, model)
        for _ in range(warm_up):
            await one()
        return {c: await drive(c, total, one, LEVEL_TIME_LIMIT_S) for c, total in levels.items()}


def _record_levels(figures: Figures, levels: dict[int, Level]) -> None:
    for c, level in levels.items():
        figures.rps[c], figures.p50_ms[c] = level.rps, level.p50


def _measure_with_cpu(base: str, cpu: Callable[[], float], figures: Figures) -> None:
    """The measures, with the CPU the served processes spend (`cpu`: their CPU seconds so far)
    per streamed token (every round, warm-up included) and per 1-token request at concurrency
    64 (its warm-up included), and the load generator's own apart."""
    before, client = cpu(), time.process_time()
    figures.tokens_per_s = asyncio.run(streamed_tokens_per_s(base, "kvmesh-demo"))
    tokens = STREAM_ROUNDS * STREAMS * STREAM_TOKENS + 8
    figures.cpu_us_per_token = (cpu() - before) / tokens * 1e6
    figures.client_cpu_us_per_token = (time.process_time() - client) / tokens * 1e6
    before, client = cpu(), time.process_time()
    first, *rest = RPS_LEVELS.items()
    levels = asyncio.run(one_token_levels(base, "kvmesh-demo", dict([first])))
    requests = levels[first[0]].requests + WARM_UP_REQUESTS
    figures.cpu_us_per_request = (cpu() - before) / requests * 1e6
    figures.client_cpu_us_per_request = (time.process_time() - client) / requests * 1e6
    levels |= asyncio.run(one_token_levels(base, "kvmesh-demo", dict(rest), warm_up=0))
    _record_levels(figures, levels)


def _spread(used: list[float]) -> float:
    return max(used) / (sum(used) / len(used)) if used and sum(used) > 0 else float("nan")


def replicas() -> Replicas:
    print("hot path: kvmesh, 2 frontends on one port and 2 processors ...", flush=True)
    with launched_mesh("--engine", "mocker", "--speedup", "inf", "--decode-workers", "1", "--frontends", "2",
                       "--processors", "2") as mesh:
        watched = {name: mesh.pids(name) for name in ("frontend", "processor")}
        before = {name: {pid: cpu_seconds(pid) for pid in pids} for name, pids in watched.items()}
        tokens_per_s = asyncio.run(streamed_tokens_per_s(mesh.base, "kvmesh-demo"))
        rps = asyncio.run(one_token_levels(mesh.base, "kvmesh-demo", {64: RPS_LEVELS[64]}))[64].rps
        used = {name: [cpu_seconds(pid) - before[name][pid] for pid in pids] for name, pids in watched.items()}
    return Replicas(tokens_per_s, rps, _spread(used["frontend"]), _spread(used["processor"]))


# (label, launcher flags after the zero-compute mocker's): every layout measured beside Dynamo.
LAYOUTS = (
    ("kvmesh", ()),
    ("kvmesh, local routing", ("--routing", "local")),
    ("kvmesh, embedded processor + local routing", ("--embed-processors", "--routing", "local")),
    # Dynamo's frontend is one process with a thread per core: this is the mesh's way to use both.
    ("kvmesh, 2 gateways with embedded processors + local routing",
     ("--frontends", "2", "--embed-processors", "--routing", "local")),
)
REPEATS = 3


def _kvmesh(flags: tuple[str, ...]) -> Figures:
    figures = Figures()
    with launched_mesh("--engine", "mocker", "--speedup", "inf", "--decode-workers", "1", *flags) as mesh:
        _measure_with_cpu(mesh.base, mesh.cpu, figures)
    return figures


def _dynamo() -> Figures:
    figures = Figures()
    try:
        with dynamo.serving(ensure_demo_model(), "kvmesh-demo", speedup=100000.0) as served:
            _measure_with_cpu(served.base, lambda: sum(cpu_seconds(p) for g in served.pids.values() for p in g),
                              figures)
    except dynamo.Unavailable as exc:
        figures.note = str(exc)
        print(f"hot path: Dynamo skipped: {exc}", flush=True)
    return figures


def _ratio(ours: float, theirs: float) -> str:
    return f"{ours / theirs:.2f}x" if theirs == theirs and theirs > 0 else "-"


MEASURES: tuple[tuple[str, Callable[[Figures], float]], ...] = (
    ("streamed output tokens/s, 64 x 128", lambda f: f.tokens_per_s),
    ("1-token completions/s, concurrency 64", lambda f: f.rps.get(64, NAN)),
    ("1-token completions/s, concurrency 16", lambda f: f.rps.get(16, NAN)),
    ("p50 ms, 1-token completion, concurrency 1", lambda f: f.p50_ms.get(1, NAN)),
    ("mesh CPU us per 1-token request", lambda f: f.cpu_us_per_request),
    ("mesh CPU us per streamed token", lambda f: f.cpu_us_per_token),
)
NAN = float("nan")


def _repeated() -> tuple[dict[str, list[Figures]], list[Figures]]:
    """REPEATS rounds, each every layout then Dynamo, so drifts of the machine hit them alike."""
    ours: dict[str, list[Figures]] = {label: [] for label, _ in LAYOUTS}
    theirs: list[Figures] = []
    for round_ in range(1, REPEATS + 1):
        for label, flags in LAYOUTS:
            print(f"hot path: {label}, zero-compute mocker (round {round_} of {REPEATS}) ...", flush=True)
            ours[label].append(_kvmesh(flags))
        print(f"hot path: NVIDIA Dynamo, zero-compute mocker (round {round_} of {REPEATS}) ...", flush=True)
        theirs.append(_dynamo())
    return ours, theirs


def _ratios(ours: list[Figures], theirs: list[Figures], pick: Callable[[Figures], float]) -> list[float]:
    """kvmesh / Dynamo per round (the two measured minutes apart)."""
    return [pick(a) / pick(b) for a, b in zip(ours, theirs, strict=True) if pick(b) == pick(b) and pick(b) > 0]


def run(with_scale: bool = True) -> dict:
    ours, theirs = _repeated()
    dynamo_ok = not any(f.note for f in theirs)
    headers = ["measure", "Dynamo"] + [h for label, _ in LAYOUTS for h in (label, "ratio")]
    rows = []
    for measure, pick in MEASURES:
        row: list[object] = [measure, median_range([pick(f) for f in theirs], "{:.1f}") if dynamo_ok else "-"]
        for label, _ in LAYOUTS:
            row.append(median_range([pick(f) for f in ours[label]], "{:.1f}"))
            row.append(median_range(_ratios(ours[label], theirs, pick), "{:.2f}") if dynamo_ok else "-")
        rows.append(row)
    table(f"Hot path: kvmesh against NVIDIA Dynamo 1.6.1 (same machine; {REPEATS} rounds, median [lowest-highest]; "
          "ratio = kvmesh / Dynamo in each round; Dynamo: its frontend with --router-mode kv, its mocker, "
          "--request-plane tcp, --event-plane zmq)", headers, rows)
    if not dynamo_ok:
        print(f"(Dynamo: {theirs[0].note})")
    table("What the mesh's processes spend (etcd excluded), and apart the load generator's (median of the rounds)",
          ["layout", "CPU us per streamed token", "CPU us per 1-token request", "client us/token", "client us/request"],
          [[label, *(statistics.median(getattr(f, name) for f in ours[label])
                     for name in ("cpu_us_per_token", "cpu_us_per_request", "client_cpu_us_per_token",
                                  "client_cpu_us_per_request"))] for label, _ in LAYOUTS]
          + ([["NVIDIA Dynamo", *(statistics.median(getattr(f, name) for f in theirs)
                                  for name in ("cpu_us_per_token", "cpu_us_per_request", "client_cpu_us_per_token",
                                               "client_cpu_us_per_request"))]] if dynamo_ok else []))
    profile = request_profile.run()
    default = ours[LAYOUTS[0][0]]
    rep = replicas()
    table("Replicas (kvmesh): 2 frontends sharing one port (SO_REUSEPORT), 2 processors",
          ["streamed tokens/s", "vs 1+1", "req/s c64", "vs 1+1", "frontend CPU max/mean", "processor CPU max/mean"],
          [[rep.tokens_per_s, _ratio(rep.tokens_per_s, statistics.median(f.tokens_per_s for f in default)), rep.rps,
            _ratio(rep.rps, statistics.median(f.rps[64] for f in default)), rep.frontend_spread,
            rep.processor_spread]])
    steps = one_worker.run()
    scale = run_scale() if with_scale else {}
    if dynamo_ok:
        bar_plot("hot_path", "kvmesh relative to NVIDIA Dynamo (1.0 = equal; median of the rounds)",
                 ["tokens/s", "req/s c64", "req/s c16"],
                 {label: [statistics.median(_ratios(ours[label], theirs, pick)) for _, pick in MEASURES[:3]]
                  for label, _ in LAYOUTS}, "ratio")
    result = {"layouts": {label: [f.__dict__ for f in figures] for label, figures in ours.items()},
              "dynamo": [f.__dict__ for f in theirs], "request_profile": profile, "replicas": rep.__dict__,
              "one_worker": steps, **scale}
    save_json("hot_path", result)
    return result
