"""The hot path against NVIDIA Dynamo: streamed tokens/s and 1-token requests/s through one
frontend, one processor (Dynamo: its frontend, which tokenizes itself) and one zero-compute mocker
worker, both systems on this machine in the same run.

Measures (the issue's table):
- streamed output tokens/s, 64 concurrent streams of 128 tokens (rounds of 64, best of 3);
- 1-token completions/s at concurrency 64 and 16, and p50 latency at concurrency 1;
- streams on one mocker worker stepping every 20 ms, 512 to 4,096 of them (one_worker.py): how
  close to the engine's pace the mesh keeps them, and what each process and hop adds;
- what a token and a request cost in CPU across the mesh's processes (to size a cluster), and
  how 2 frontends (one port, SO_REUSEPORT) and 2 processors share the load.
Dynamo is installed into its own venv on first use (bench/hot_path/dynamo.py); where that is
impossible its column says why and kvmesh's figures still print.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from bench.hot_path import dynamo, one_worker
from bench.mesh_overhead import Level, drive
from bench.hot_path.scale import run_scale
from testkit.mesh import LaunchedMesh, launched_mesh
from testkit.proc_stat import cpu_seconds
from bench.hot_path.stream_load import PROMPT, one_stream
from bench.common.report import bar_plot, save_json, table
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
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1}
    async with aiohttp.ClientSession(base, connector=aiohttp.TCPConnector(limit=256)) as session:
        async def one() -> None:
            async with session.post("/v1/completions", json=body) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{r.status}: {(await r.text())[:200]}")

        for _ in range(warm_up):
            await one()
        return {c: await drive(c, total, one, LEVEL_TIME_LIMIT_S) for c, total in levels.items()}


def measure(base: str, model: str, figures: Figures) -> None:
    figures.tokens_per_s = asyncio.run(streamed_tokens_per_s(base, model))
    _record_levels(figures, asyncio.run(one_token_levels(base, model, RPS_LEVELS)))


def _record_levels(figures: Figures, levels: dict[int, Level]) -> None:
    for c, level in levels.items():
        figures.rps[c], figures.p50_ms[c] = level.rps, level.p50


def _measure_with_cpu(mesh: LaunchedMesh, figures: Figures) -> None:
    """`measure`, with the CPU the mesh's processes spend per streamed token (every round, warm-up
    included) and per 1-token request at concurrency 64 (its warm-up included)."""
    before, client = mesh.cpu(), time.process_time()
    figures.tokens_per_s = asyncio.run(streamed_tokens_per_s(mesh.base, "kvmesh-demo"))
    tokens = STREAM_ROUNDS * STREAMS * STREAM_TOKENS + 8
    figures.cpu_us_per_token = (mesh.cpu() - before) / tokens * 1e6
    figures.client_cpu_us_per_token = (time.process_time() - client) / tokens * 1e6
    before, client = mesh.cpu(), time.process_time()
    first, *rest = RPS_LEVELS.items()
    levels = asyncio.run(one_token_levels(mesh.base, "kvmesh-demo", dict([first])))
    requests = levels[first[0]].requests + WARM_UP_REQUESTS
    figures.cpu_us_per_request = (mesh.cpu() - before) / requests * 1e6
    figures.client_cpu_us_per_request = (time.process_time() - client) / requests * 1e6
    levels |= asyncio.run(one_token_levels(mesh.base, "kvmesh-demo", dict(rest), warm_up=0))
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


def _kvmesh(figures: Figures, local: Figures) -> None:
    print("hot path: kvmesh, zero-compute mocker ...", flush=True)
    with launched_mesh("--engine", "mocker", "--speedup", "inf", "--decode-workers", "1") as mesh:
        _measure_with_cpu(mesh, figures)
    print("hot path: kvmesh, zero-compute mocker, the processor routing in-process ...", flush=True)
    with launched_mesh("--engine", "mocker", "--speedup", "inf", "--decode-workers", "1", "--routing", "local") as mesh:
        _measure_with_cpu(mesh, local)


def _dynamo(figures: Figures) -> None:
    model_dir = ensure_demo_model()
    try:
        print("hot path: NVIDIA Dynamo, zero-compute mocker ...", flush=True)
        with dynamo.served(model_dir, "kvmesh-demo", speedup=100000.0) as base:
            measure(base, "kvmesh-demo", figures)
    except dynamo.Unavailable as exc:
        figures.note = str(exc)
        print(f"hot path: Dynamo skipped: {exc}", flush=True)


def _ratio(ours: float, theirs: float) -> str:
    return f"{ours / theirs:.2f}x" if theirs == theirs and theirs > 0 else "-"


def run(with_scale: bool = True) -> dict:
    ours, local, theirs = Figures(), Figures(), Figures()
    _kvmesh(ours, local)
    _dynamo(theirs)

    def row(measure: str, pick: Callable[[Figures], float]) -> list[object]:
        return [measure, pick(theirs), pick(ours), _ratio(pick(ours), pick(theirs)), pick(local),
                _ratio(pick(local), pick(theirs))]

    nan = float("nan")
    rows = [row("streamed output tokens/s, 64 x 128", lambda f: f.tokens_per_s)]
    for c in (64, 16):
        rows.append(row(f"1-token completions/s, concurrency {c}", lambda f, c=c: f.rps.get(c, nan)))
    rows.append(row("p50 ms, 1-token completion, concurrency 1", lambda f: f.p50_ms.get(1, nan)))
    rows.append(row("mesh CPU us per 1-token request", lambda f: f.cpu_us_per_request))
    rows.append(row("mesh CPU us per streamed token", lambda f: f.cpu_us_per_token))
    table("Hot path: kvmesh against NVIDIA Dynamo 1.6.1 (same machine, same run; ratio = kvmesh / Dynamo; "
          "routing by the kv-router service (default) and inside the processor (--routing local))",
          ["measure", "Dynamo", "kvmesh", "ratio", "kvmesh, local routing", "ratio"], rows)
    if theirs.note:
        print(f"(Dynamo: {theirs.note})")
    table("What the mesh's processes spend (kvmesh; etcd excluded), and apart the load generator's",
          ["CPU us per streamed token", "CPU us per 1-token request", "tokens/s per core", "requests/s per core",
           "client us/token", "client us/request"],
          [[ours.cpu_us_per_token, ours.cpu_us_per_request, 1e6 / ours.cpu_us_per_token,
            1e6 / ours.cpu_us_per_request, ours.client_cpu_us_per_token, ours.client_cpu_us_per_request]])
    rep = replicas()
    table("Replicas (kvmesh): 2 frontends sharing one port (SO_REUSEPORT), 2 processors",
          ["streamed tokens/s", "vs 1+1", "req/s c64", "vs 1+1", "frontend CPU max/mean", "processor CPU max/mean"],
          [[rep.tokens_per_s, _ratio(rep.tokens_per_s, ours.tokens_per_s), rep.rps, _ratio(rep.rps, ours.rps[64]),
            rep.frontend_spread, rep.processor_spread]])
    steps = one_worker.run()
    scale = run_scale() if with_scale else {}
    if not theirs.note:
        bar_plot("hot_path", "kvmesh relative to NVIDIA Dynamo (1.0 = equal)", ["tokens/s", "req/s c64", "req/s c16"],
                 {"kvmesh / Dynamo": [ours.tokens_per_s / theirs.tokens_per_s, ours.rps[64] / theirs.rps[64],
                                      ours.rps[16] / theirs.rps[16]]}, "ratio")
    result = {"kvmesh": ours.__dict__, "kvmesh_local_routing": local.__dict__,
              "dynamo": theirs.__dict__, "replicas": rep.__dict__, "one_worker": steps,
              **scale}
    save_json("hot_path", result)
    return result
