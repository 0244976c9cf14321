"""LoRA placement: adapter-aware routing against adapter-blind kv routing and round-robin, on two workloads.

Mesh: the launcher with WORKERS mocker decode workers (default timing: an 8B model on an H100-class GPU, slowed
down SPEEDUP = 0.5 times so that the workers are moderately loaded at a rate this machine can send), each
knowing all of the workload's adapters (`--lora-modules`) and holding at most MAX_LORAS of them loaded; an
adapter load stalls the worker's engine step for a time set by the adapter's size. Workloads (CASES; each
bench/lora/workload.py's 32 adapters, Zipf(1.1) popularity, a per-adapter system prefix + a user part of the
request's own, Poisson arrivals):
- long prefix: a 1,536-token system prefix + a 64-token user part. The prefix holder's overlap term (2 x 0.96)
  outweighs every other term, so blind routing already keeps each adapter where its prefix is cached;
- short prefix: a 128-token system prefix + a 1,024-token user part. The prefix is worth 2 x 0.11 = 0.22 of
  logit, less than the adapter term (at most 0.5), so where the adapter is resident is left to the adapter term.

Modes, each on a fresh mesh, its router seeded with the run's seed:
- aware: kv routing with its default LoRA weight (residency of the adapter, or the cost of loading it, counts);
- blind: kv routing with `--lora-weight 0`: residency ignored (block hashes are still per adapter, so the
  overlap term alone still draws an adapter's requests to where its prefix is cached): the baseline;
- round-robin.

Figures of the measured phase (the warm-up left out): adapter loads per 1,000 requests (the workers' load
counters), TTFT p50/p99, prefix reuse (cached over prompt tokens, as the responses' usage says). The seeds are
paired: each mode of one seed gets the very same requests, and ratios are taken per seed against blind, then
shown as median [min-max]. The floor row is the fewest loads any placement could do on those requests
(workload.fewest_loads over all WORKERS * MAX_LORAS slots). report.py prints each workload's tables.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from bench.common.report import save_json
from bench.lora import adapter_metrics
from bench.lora.adapter_metrics import AdapterSnapshot
from bench.lora.drive import drive
from bench.lora.plot import plot
from bench.lora.record import Case, Run
from bench.lora.report import BASELINE, floors, report
from bench.lora.workload import LoraWorkload, fewest_loads, requests, write_adapters
from testkit.mesh import launched_mesh
from testkit.proc import ROOT

WORKERS = 4
MAX_LORAS = 4
# Every mocker step and adapter load takes twice the H100 profile's time: at RATE req/s the workers are as busy
# as H100s at 2 x RATE, a load this 2-core machine cannot drive the mesh at. Queues form; none collapses.
SPEEDUP = 0.5
MODES: dict[str, tuple[str, ...]] = {
    "aware": ("--router-mode", "kv"),
    BASELINE: ("--router-mode", "kv", "--lora-weight", "0"),
    "round-robin": ("--router-mode", "round-robin"),
}
PHASE_LIMIT_S = 60.0  # arrivals of one phase; at the workload's rate the measured one needs about 30 s
ADAPTER_DIR = ROOT / ".cache" / "bench-lora" / "adapters"

CASES = (
    Case("long_prefix", "long prefix", LoraWorkload(prefix_tokens=1536, user_tokens=64)),
    Case("short_prefix", "short prefix", LoraWorkload(prefix_tokens=128, user_tokens=1024)),
)


def mesh_flags(mode: str, seed: int, modules: dict[str, Path]) -> list[str]:
    return ["--engine", "mocker", "--speedup", f"{SPEEDUP:g}", "--decode-workers", str(WORKERS), "--max-loras", str(MAX_LORAS),
            "--lora-modules", *(f"{name}={path}" for name, path in modules.items()),
            *MODES[mode], "--seed", str(seed)]


def one_run(case: Case, mode: str, seed: int, modules: dict[str, Path]) -> Run:
    started = time.monotonic()
    workload = case.workload
    sent = requests(workload, seed)
    floor = fewest_loads([r.adapter for r in sent], WORKERS * MAX_LORAS, counted_from=workload.warmup_requests)
    with launched_mesh(*mesh_flags(mode, seed, modules)) as mesh:
        urls = adapter_metrics.worker_urls(mesh)
        if not urls:  # one worker process may serve several workers, on one /metrics
            raise RuntimeError("lora: found no decode worker's /metrics")
        before: list[AdapterSnapshot] = []

        async def between() -> None:
            before.append(await asyncio.to_thread(adapter_metrics.snapshot, urls))

        warmup, measured = asyncio.run(drive(mesh.base, sent, workload.output_tokens, PHASE_LIMIT_S, between))
        after = adapter_metrics.snapshot(urls)
    return Run(case, mode, seed, warmup, measured, after.minus(before[0]), after.resident_by_worker(), floor,
               time.monotonic() - started, WORKERS, workload.names())


def run_case(case: Case) -> list[Run]:
    modules = write_adapters(case.workload, ADAPTER_DIR)
    runs = []
    for seed in case.seeds:
        for mode in MODES:  # the modes alternate within a seed, so a slow spell of the machine hits all of them
            print(f"lora, {case.title}: seed {seed}, {mode} ...", flush=True)
            runs.append(one_run(case, mode, seed, modules))
            r = runs[-1]
            f = r.figures()
            print(f"  {len(r.measured.done)} done, {r.measured.failures} failed, {f['loads_per_1k']:.0f} loads/1k, "
                  f"TTFT p50 {f['ttft_p50_ms']:.0f} ms p99 {f['ttft_p99_ms']:.0f} ms, reuse {f['reuse']:.1%} "
                  f"({r.seconds:.0f} s)", flush=True)
    return runs


def run() -> dict:
    started = time.monotonic()
    sections: dict[str, dict] = {}
    panels = []
    for case in CASES:
        case_started = time.monotonic()
        runs = run_case(case)
        sections[case.key] = report(case, runs, list(MODES), WORKERS, MAX_LORAS, time.monotonic() - case_started)
        panels.append((case.title, runs, floors(runs)))
    seconds = time.monotonic() - started
    print(f"lora: both workloads in {seconds:.0f} s", flush=True)
    plot(panels, list(MODES))
    data = {"workers": WORKERS, "max_loras": MAX_LORAS, "speedup": SPEEDUP,
            "modes": {m: list(f) for m, f in MODES.items()}, "baseline": BASELINE, "seconds": round(seconds, 1),
            "workloads": sections}
    save_json("lora_placement", data)
    return data
