"""The planner against every fixed prefill:decode split, on a workload whose needs change.

A mocker mesh of 6 workers (`--timing large-gpu-8b`, slowed by SPEEDUP so that the simulated
GPU time, not this 2-core machine's CPU, sets the latencies) serves a two-phase workload
(load.py): phase A, long prompts with short outputs, which needs a large prefill pool;
a ramp; phase B, short prompts with long outputs, which needs a large decode pool. Open-loop
Poisson arrivals from a fixed seed: every configuration gets the same requests at the same times.

Configurations, all with the same process layout (`--planner local`: each worker a switchable
process, a planner running): every fixed split p:(6-p), p = 1..5, pinned by
`--min/--max-prefill-workers p --min/--max-decode-workers 6-p --total-workers 6` so its planner
can never change anything; and the planner twice, starting from 3:3 with the same budget of 6
(`--total-workers 6`: it only switches roles), free between 1:5 and 5:1: once with the profile
`python -m services.planner profile` measured on one worker like these (profiles.py), once
with that profile made 2x too fast, so that its calibration has to do real work.

Prompts longer than MAX_LOCAL_PREFILL tokens (phase A's) are prefilled on the prefill pool, the
short ones (phase B's) locally on the decode workers; the prefill queue limit is set high
enough that a long prompt always goes to the prefill pool, so a split is what it says (with
the default limit of 2, a small prefill pool would hand its overflow to the decode workers and
every split would behave like a mix of aggregated and disaggregated serving). A remote prefill
still unfinished after --prefill-timeout (30 s) falls back to a local one, as in production:
the splits with too small a prefill pool for phase A show it.

Measured per configuration and phase (a request belongs to the phase it arrived in): goodput,
requests per second of the phase meeting both SLOs (TTFT <= TTFT_SLO_S, and the mean time
between the tokens of its stream <= ITL_SLO_S); p50 TTFT and p50 of the requests' mean ITL.
The split over time is sampled from etcd every second (split.py). Goal: the planner's
overall goodput >= 1.2x the best fixed split's, and within 10% of the best fixed split in each
of phase A and phase B. Output: a table, bench/results/planner.json, planner_goodput.png
(goodput per configuration and phase), planner_split.png (the planner's split over time) and
planner_predictions.png (each interval's TTFT and ITL, observed and as the planner's model said).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from testkit.mesh import launched_mesh
from testkit.proc_stat import argv as proc_argv
from testkit.proc_stat import running
from bench.planner.cpu import CpuMeter
from bench.planner.load import PHASES, Arrival, Outcome, Shape, Workload, replay, schedule
from bench.planner.predictions import intervals, plot, print_accuracy
from bench.planner.profiles import measured_profile, off_by
from bench.planner.split import PlanLine, SplitSampler, etcd_endpoint, plan_lines, warnings_of
from bench.common.report import bar_plot, median, save_figure, save_json, table

TOTAL_WORKERS = 6
# The simulated GPU at a tenth of the preset's speed: a decode step of 80 ms and up, a 512-token
# prompt prefilled in ~155 ms. At full speed, loading 6 workers would need ten times the tokens
# per second, more than 2 cores stream through the mesh: latencies would measure CPU contention.
SPEEDUP = 0.1
# The phases need opposite splits, so that no fixed split serves both. Phase A: ~3.5 prefill
# workers' worth of prompts (3 saturate, 4 or 5 keep up), outputs too short to load the decode
# pool. Phase B: prompts short enough to be prefilled on the decode workers, outputs long enough
# that 3 decode workers miss the ITL objective and 4 or more meet it. The request rates are of
# the same order, so neither phase alone decides the overall goodput. (With 23 req/s in phase A
# and a 300 ms ITL objective, 3:3 met both phases' objectives for 94% of the requests: no
# planner could then beat the best fixed split by more than 1.07x.)
WORKLOAD = Workload(phase_a_s=60.0, ramp_s=20.0, phase_b_s=60.0, rate_a=28.0, rate_b=30.0,
                    shape_a=Shape(prompt_tokens=512, output_tokens=8),
                    shape_b=Shape(prompt_tokens=64, output_tokens=64), seed=7)
TTFT_SLO_S, ITL_SLO_S = 1.0, 0.24
# Between phase B's prompts (local) and phase A's (remote).
MAX_LOCAL_PREFILL = 256
# A plan every 2.5 s (24 per phase: a late first switch costs phase A its first seconds); a new
# split is kept at least 20 s, so that a burst of answers (the planner measures the traffic by
# the requests answered) does not flap it back at once.
PLANNER_INTERVAL_S, PLANNER_COOLDOWN_S = 2.5, 20.0
# A request that meets both SLOs ends within TTFT + outputs x ITL of its arrival; one still
# unanswered that long (and a margin) after the last arrival cannot, and counts as failed.
REQUEST_TIMEOUT_S = 120.0
DRAIN_S = TTFT_SLO_S + max(WORKLOAD.shape_a.output_tokens, WORKLOAD.shape_b.output_tokens) * ITL_SLO_S + 10.0
NAMESPACE = "bench-planner"
RUNS = Path(".cache/runs/bench-planner")
GOAL_OVERALL, GOAL_PHASE = 1.2, 0.9


ENGINE = ("--engine", "mocker", "--timing", "large-gpu-8b", "--speedup", str(SPEEDUP),
          # Small synthetic KV: the transfer is real, its size scaled down to spare the CPU.
          "--kv-bytes-per-token", "256")
PLANNERS = ("planner", "planner, profile 2x off")


def common_flags() -> tuple[str, ...]:
    return (*ENGINE, "--namespace", NAMESPACE, "--log-level", "INFO", "--planner", "local",
            "--total-workers", str(TOTAL_WORKERS), "--ttft-slo-ms", str(TTFT_SLO_S * 1000),
            "--itl-slo-ms", str(ITL_SLO_S * 1000), "--adjustment-interval", str(PLANNER_INTERVAL_S),
            "--cooldown", str(PLANNER_COOLDOWN_S), "--max-local-prefill-length", str(MAX_LOCAL_PREFILL),
            # A long prompt always goes to the prefill pool (see the docstring).
            "--max-prefill-queue-size", "100000")


def fixed_flags(prefill: int) -> tuple[str, ...]:
    decode = TOTAL_WORKERS - prefill
    return ("--prefill-workers", str(prefill), "--decode-workers", str(decode),
            "--min-prefill-workers", str(prefill), "--max-prefill-workers", str(prefill),
            "--min-decode-workers", str(decode), "--max-decode-workers", str(decode))


def planner_flags(profile: Path) -> tuple[str, ...]:
    half = TOTAL_WORKERS // 2
    return ("--prefill-workers", str(half), "--decode-workers", str(TOTAL_WORKERS - half),
            "--min-prefill-workers", "1", "--max-prefill-workers", str(TOTAL_WORKERS - 1),
            "--min-decode-workers", "1", "--max-decode-workers", str(TOTAL_WORKERS - 1),
            # Measured as it is: the mocker's speedup is already in it.
            "--profile", str(profile.resolve()), "--profile-speedup", "1")


def configurations(measured: Path, two_x_off: Path) -> dict[str, tuple[str, ...]]:
    fixed = {f"{p}:{TOTAL_WORKERS - p}": fixed_flags(p) for p in range(1, TOTAL_WORKERS)}
    return fixed | {PLANNERS[0]: planner_flags(measured), PLANNERS[1]: planner_flags(two_x_off)}


@dataclass
class Run:
    name: str
    outcomes: list[Outcome]
    split: list[tuple[float, int, int]]
    plans: list[PlanLine] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # Share of the machine's CPU in use during the replay (all processes, this one included).
    cpu_busy: float = float("nan")
    wall_s: float = 0.0
    started_wall: float = float("nan")


async def _replay_sampled(base: str, sampler: SplitSampler, arrivals: list[Arrival]) -> list[Outcome]:
    try:
        return await replay(base, arrivals, REQUEST_TIMEOUT_S, DRAIN_S, on_start=sampler.start)
    finally:
        await sampler.stop()


def run_one(name: str, flags: tuple[str, ...], arrivals: list[Arrival]) -> Run:
    """One configuration: a fresh mesh, the whole schedule, the split sampled throughout."""
    run_dir = RUNS / name.replace(":", "-").replace(", ", "-").replace(" ", "-")
    shutil.rmtree(run_dir, ignore_errors=True)
    print(f"planner: {name} ...", flush=True)
    started = time.monotonic()
    pids: list[int] = []
    try:
        with launched_mesh(*common_flags(), *flags, "--run-dir", str(run_dir)) as mesh:
            pids = [pid for _, pid in mesh.children]
            sampler = SplitSampler(etcd_endpoint(mesh.pids("etcd")[0]), NAMESPACE)
            meter = CpuMeter()
            meter.start()
            outcomes = asyncio.run(_replay_sampled(mesh.base, sampler, arrivals))
            cpu_busy = meter.stop()
    finally:
        reap(pids)
    run = Run(name, outcomes, sampler.samples, plan_lines(run_dir), warnings_of(run_dir), cpu_busy,
              time.monotonic() - started, sampler.started_wall)
    good = sum(o.good(TTFT_SLO_S, ITL_SLO_S) for o in outcomes)
    print(f"planner: {name}: {good}/{len(outcomes)} good, {sum(not o.result.ok for o in outcomes)} failed or "
          "unfinished, "
          f"CPU {run.cpu_busy:.0%} busy, {run.wall_s:.0f}s", flush=True)
    return run


def reap(pids: list[int], grace_s: float = 10.0) -> None:
    """Makes sure the mesh's processes are gone once the launcher is: any left over (which would
    be a launcher bug, reported) gets SIGTERM, then SIGKILL after `grace_s`."""
    alive = [pid for pid in pids if _alive(pid)]
    if not alive:
        return
    print(f"planner: WARNING: {len(alive)} processes outlived the launcher: {alive}; stopping them", flush=True)
    for pid in alive:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(pid) for pid in alive):
        time.sleep(0.2)
    for pid in alive:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Still running, and still ours (a recycled pid would run something else)."""
    command = " ".join(proc_argv(pid))
    return any(name in command for name in ("services.", "etcd")) and running(pid)


# -- figures -----------------------------------------------------------------------------------

def seconds_of(phase: str) -> float:
    if phase == "overall":
        return WORKLOAD.duration_s
    start, end = WORKLOAD.bounds()[phase]
    return end - start or float("nan")  # a phase of no length has no rate


def of_phase(run: Run, phase: str) -> list[Outcome]:
    return run.outcomes if phase == "overall" else [o for o in run.outcomes if o.arrival.phase == phase]


def goodput(run: Run, phase: str) -> float:
    return sum(o.good(TTFT_SLO_S, ITL_SLO_S) for o in of_phase(run, phase)) / seconds_of(phase)


def p50_ms(run: Run, phase: str, what: str) -> float:
    ok = [o.result for o in of_phase(run, phase) if o.result.ok]
    return median([r.ttft_s if what == "ttft" else r.mean_itl_s for r in ok]) * 1000


def summary(runs: dict[str, Run], planner: str) -> dict[str, dict[str, float]]:
    """Per phase: the best fixed split's goodput and name, and the planner's ratio to it."""
    out: dict[str, dict[str, float]] = {}
    fixed = [r for name, r in runs.items() if name not in PLANNERS]
    for phase in (*PHASES, "overall"):
        best = max(fixed, key=lambda r: goodput(r, phase))
        mine = goodput(runs[planner], phase)
        out[phase] = {"best_fixed": best.name, "best_fixed_goodput": goodput(best, phase), "planner_goodput": mine,
                      "ratio": mine / goodput(best, phase) if goodput(best, phase) else float("inf")}
    best_overall = runs[str(out["overall"]["best_fixed"])]
    for phase in (*PHASES, "overall"):
        g = goodput(best_overall, phase)
        out[phase]["ratio_to_best_overall_split"] = goodput(runs[planner], phase) / g if g else float("inf")
    return out


def print_tables(runs: dict[str, Run], bests: dict[str, dict[str, dict[str, float]]]) -> None:
    phases = (*PHASES, "overall")
    table(f"Planner vs fixed splits of {TOTAL_WORKERS} mocker workers (large-gpu-8b at speedup {SPEEDUP:g}): "
          f"goodput, requests/s meeting TTFT <= {TTFT_SLO_S * 1000:.0f} ms and mean ITL <= {ITL_SLO_S * 1000:.0f} ms",
          ["config", "requests", "failed/unfinished", *(f"goodput {p}" for p in phases), "CPU busy"],
          [[r.name, len(r.outcomes), sum(not o.result.ok for o in r.outcomes), *(goodput(r, p) for p in phases),
            f"{r.cpu_busy:.0%}"] for r in runs.values()])
    table("p50 TTFT and p50 of the requests' mean ITL, per phase (ms)",
          ["config", *(f"{p} {what}" for p in PHASES for what in ("TTFT", "ITL"))],
          [[r.name, *(p50_ms(r, p, what) for p in PHASES for what in ("ttft", "itl"))] for r in runs.values()])
    for planner, best in bests.items():
        table(f"{planner} / best fixed split", ["phase", "best fixed", "its goodput", "planner", "ratio",
                                               f"ratio to {best['overall']['best_fixed']}"],
              [[p, v["best_fixed"], v["best_fixed_goodput"], v["planner_goodput"], f"{v['ratio']:.2f}x",
                f"{v['ratio_to_best_overall_split']:.2f}x"] for p, v in best.items()])
        overall, a, b = best["overall"]["ratio"], best["A"]["ratio"], best["B"]["ratio"]
        met = overall >= GOAL_OVERALL and a >= GOAL_PHASE and b >= GOAL_PHASE
        print(f"goal ({planner}): overall planner / best fixed split {overall:.2f}x (>= {GOAL_OVERALL}x), phase A "
              f"{a:.2f}x and phase B {b:.2f}x of that phase's best (>= {GOAL_PHASE}x): {'met' if met else 'NOT met'}",
              flush=True)


def print_planner_story(run: Run) -> None:
    changes = [p for p in run.plans if p.changes]
    print(f"{run.name}: {len(run.plans)} decisions, {len(changes)} re-splits:", flush=True)
    for plan in changes:
        print(f"  {plan.text[:240]}", flush=True)
    print(f"{run.name}: split timeline {compress(run.split)}", flush=True)
    print(f"{run.name}: {len(run.warnings)} WARNING/ERROR lines in its run's logs, the first:",
          flush=True)
    for line in run.warnings[:5]:
        print(f"  {line}", flush=True)


def compress(split: list[tuple[float, int, int]]) -> str:
    """'3P:3D from 0s, 5P:1D from 12s, ...': the sampled split, one entry per change."""
    parts, last = [], None
    for at, prefill, decode in split:
        if (prefill, decode) != last:
            parts.append(f"{prefill}P:{decode}D from {at:.0f}s")
            last = (prefill, decode)
    return ", ".join(parts)


def plot_split(run: Run) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.step([t for t, _, _ in run.split], [p for _, p, _ in run.split], where="post", label="prefill workers")
    ax.step([t for t, _, _ in run.split], [d for _, _, d in run.split], where="post", label="decode workers",
            linestyle="--")
    for name, (start, end) in WORKLOAD.bounds().items():
        ax.axvline(end, color="grey", linewidth=0.8)
        ax.text((start + end) / 2, TOTAL_WORKERS + 0.2, f"phase {name}" if name != "ramp" else "ramp", ha="center")
    ax.set_ylim(0, TOTAL_WORKERS + 0.8)
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("workers")
    ax.set_title(f"Planner's split over time ({TOTAL_WORKERS} workers, started at 3:3)")
    # The offered load, for reading the split against it.
    rate = ax.twinx()
    times = [i * WORKLOAD.duration_s / 200 for i in range(201)]
    rate.plot(times, [WORKLOAD.rate(t) for t in times], color="grey", linestyle=":", label="offered requests/s")
    rate.set_ylabel("offered requests/s")
    rate.set_ylim(0, max(WORKLOAD.rate_a, WORKLOAD.rate_b) * 1.3)
    lines = ax.get_lines()[:2] + rate.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], loc="center", bbox_to_anchor=(0.3, 0.42))
    return save_figure(fig, "planner_split")


def to_json(runs: dict[str, Run], bests: dict[str, dict[str, dict[str, float]]], predictions: dict[str, list[dict]],
            accuracy: dict, wall_s: float) -> dict:
    phases = (*PHASES, "overall")
    return {
        "settings": {"speedup": SPEEDUP, "workload": repr(WORKLOAD), "ttft_slo_ms": TTFT_SLO_S * 1000,
                     "itl_slo_ms": ITL_SLO_S * 1000, "interval_s": PLANNER_INTERVAL_S,
                     "cooldown_s": PLANNER_COOLDOWN_S, "max_local_prefill": MAX_LOCAL_PREFILL},
        "configs": {name: {"requests": len(r.outcomes), "failed": sum(not o.result.ok for o in r.outcomes),
                           "goodput": {p: goodput(r, p) for p in phases},
                           "ttft_p50_ms": {p: p50_ms(r, p, "ttft") for p in phases},
                           "itl_p50_ms": {p: p50_ms(r, p, "itl") for p in phases},
                           "cpu_busy": r.cpu_busy, "wall_s": r.wall_s, "split": r.split,
                           "plans": [p.text for p in r.plans if p.changes]} for name, r in runs.items()},
        "vs_best_fixed": bests,
        "predictions": predictions,
        "prediction_accuracy": accuracy,
        "wall_s": wall_s,
    }


def run() -> dict:
    started = time.monotonic()
    arrivals = schedule(WORKLOAD)
    RUNS.mkdir(parents=True, exist_ok=True)
    measured = RUNS / "profile.json"
    profile = measured_profile(ENGINE, measured)
    two_x_off = off_by(profile, 0.5, RUNS / "profile-2x-off.json")
    print(f"planner: {len(arrivals)} requests over {WORKLOAD.duration_s:.0f}s per configuration", flush=True)
    runs = {name: run_one(name, flags, arrivals) for name, flags in configurations(measured, two_x_off).items()}
    bests = {name: summary(runs, name) for name in PLANNERS}
    print_tables(runs, bests)
    predictions = {name: intervals(runs[name].plans, runs[name].started_wall, WORKLOAD.phase_of, WORKLOAD.duration_s)
                   for name in PLANNERS}
    accuracy = print_accuracy(predictions, PHASES)
    for name in PLANNERS:
        print_planner_story(runs[name])
    bar_plot("planner_goodput", "Goodput per phase (requests/s meeting both SLOs)", [*PHASES, "overall"],
             {name: [goodput(r, p) for p in (*PHASES, "overall")] for name, r in runs.items()}, "requests/s")
    plot_split(runs[PLANNERS[0]])
    plot(predictions)
    wall_s = time.monotonic() - started
    print(f"planner: benchmark wall time {wall_s:.0f}s", flush=True)
    data = to_json(runs, bests, predictions, accuracy, wall_s)
    save_json("planner", data)
    return data
