"""make bench ARGS="--only overload": a storm against two decode workers, kvmesh's admission
against NVIDIA Dynamo 1.6.1 (its defaults, and its router queue), in the same run.

The setting (issue 29): two mocker decode workers of 16 slots each (kvmesh: the fixed 20 ms step
preset; Dynamo: its mocker's own timing, the nearest it has), KV routing, two tenants. Per
system and repeat:
- idle TTFT (10 requests one at a time), and the SLO: TTFT <= max(1 s, 5 x idle) and the whole
  answer; kvmesh is told the same objective per request (x-kvmesh-ttft-objective-ms);
- capacity X: completed requests per second with 64 clients back to back;
- the light tenant alone (0.15 X for 10 s): its median TTFT is the figure its recovery after the
  storm is measured against (on a 20 ms step a request that arrives while others decode waits
  for a step, so one request at a time is not what the light tenant ever sees);
- 20 s of Poisson arrivals at 1 X (nothing may be refused);
- the storm: tenant A at 4 X for 30 s, tenant B at 0.15 X for 45 s (15 s alone after it);
- the same storm with 20% of A's requests at a high priority.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from testkit.mesh import launched_mesh
from bench.common.report import RESULTS, median_range, save_figure, save_json, table
from bench.hot_path import dynamo
from bench.overload.storm import Flow, Outcome, closed_loop, idle_ttft, run_flows
from services.tools.make_demo_model import ensure_demo_model

KEYS = {"A": "bench-key-a", "B": "bench-key-b"}
SLOTS = 16
STORM_S, AFTER_S, ONE_X_S, CAPACITY_S, LIGHT_ALONE_S = 30.0, 15.0, 20.0, 10.0, 10.0
HEAVY, LIGHT, HIGH_SHARE = 4.0, 0.15, 0.2
REPEATS = 2
FAST_REFUSAL_S = 0.05


@dataclass
class System:
    name: str
    serve: Callable[[], AbstractContextManager[str]]
    # Sends the SLO as each request's own objective (kvmesh's header).
    objective_header: bool = False


@dataclass
class Run:
    idle_s: float
    slo_s: float
    light_alone_s: float
    capacity: float
    one_x: list[Outcome]
    storm: list[Outcome]
    priority: list[Outcome]
    figures: dict[str, float] = field(default_factory=dict)


@contextmanager
def kvmesh() -> Iterator[str]:
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys"
        keys.write_text("".join(f"{key} tenant-{tenant}\n" for tenant, key in KEYS.items()))
        flags = ["--engine", "mocker", "--decode-workers", "2", "--timing", "fixed-step-20ms", "--speedup", "1",
                 "--max-num-seqs", str(SLOTS), "--api-key-file", str(keys)]
        with launched_mesh(*flags) as mesh:
            yield mesh.base


def dynamo_serving(queue: bool) -> Callable[[], AbstractContextManager[str]]:
    # Its router queue: requests wait in the router once every worker has prefill work in
    # flight (the most sensitive threshold), first come first served with priority bumps.
    frontend = ["--router-queue-threshold", "0.0", "--router-queue-policy", "fcfs"] if queue else []
    return lambda: dynamo.served(ensure_demo_model(), "kvmesh-demo", workers=2, speedup=1.0,
                                 frontend_flags=frontend, mocker_flags=["--max-num-seqs", str(SLOTS)])


def measure(system: System, seed: int) -> Run:
    with system.serve() as base:
        idle = asyncio.run(idle_ttft(base, KEYS["B"]))
        slo = max(1.0, 5 * idle)
        headers = {"x-kvmesh-ttft-objective-ms": str(round(slo * 1000))} if system.objective_header else None
        capacity = asyncio.run(closed_loop(base, KEYS["A"], 64, CAPACITY_S, headers))
        alone = asyncio.run(run_flows(base, [Flow("B", KEYS["B"], LIGHT * capacity, 0, LIGHT_ALONE_S)], seed,
                                      headers=headers))
        light_alone = statistics.median(o.ttft_s for o in alone if o.served)
        one_x = asyncio.run(run_flows(base, [Flow("A", KEYS["A"], capacity, 0, ONE_X_S)], seed, headers=headers))
        end = STORM_S + AFTER_S
        storm = [Flow("A", KEYS["A"], HEAVY * capacity, 0, STORM_S), Flow("B", KEYS["B"], LIGHT * capacity, 0, end)]
        outcomes = asyncio.run(run_flows(base, storm, seed + 1, headers=headers))
        storm[0] = Flow("A", KEYS["A"], HEAVY * capacity, 0, STORM_S, HIGH_SHARE)
        priority = asyncio.run(run_flows(base, storm, seed + 2, headers=headers))
    run = Run(idle, slo, light_alone, capacity, one_x, outcomes, priority)
    run.figures = figures(run)
    print(f"  {system.name} (seed {seed}): " + ", ".join(f"{k} {v:.3g}" for k, v in run.figures.items()))
    return run


def share(outcomes: list[Outcome], slo_s: float) -> float:
    return sum(o.within(slo_s) for o in outcomes) / len(outcomes) if outcomes else float("nan")


def back_after_s(outcomes: list[Outcome], idle_s: float) -> float:
    """Seconds after the storm until B's TTFT is back under twice `idle_s` and stays there:
    the start of the first 1 s window after which every window's median is under it (inf: not
    within the run). A median, not every request: on a 20 ms step single requests land anywhere
    in a step, idle or not."""
    after = [o for o in outcomes if o.tenant == "B" and o.sent_at >= STORM_S]
    windows = []
    start = STORM_S
    while start < STORM_S + AFTER_S:
        inside = [o.ttft_s if o.served else float("inf") for o in after if start <= o.sent_at < start + 1.0]
        windows.append((start, statistics.median(inside) if inside else 0.0))
        start += 1.0
    back = float("inf")
    for start, median in windows:
        if median >= 2 * idle_s:
            back = float("inf")
        elif back == float("inf"):
            back = start - STORM_S
    return back


def figures(run: Run) -> dict[str, float]:
    storm = run.storm
    during = [o for o in storm if o.sent_at < STORM_S]
    refused = [o for o in storm + run.priority if o.status in (429, 503)]
    with_retry = [o for o in refused if o.retry_after]
    high = [o for o in run.priority if o.high]
    low = [o for o in run.priority if o.tenant == "A" and not o.high]
    served = [o.ttft_s for o in storm if o.served]
    return {
        "capacity_rps": run.capacity,
        "idle_ttft_ms": run.idle_s * 1000,
        "one_x_refused": sum(o.status != 200 for o in run.one_x),
        "goodput_over_x": sum(o.within(run.slo_s) for o in during) / STORM_S / run.capacity,
        "a_within_slo": share([o for o in storm if o.tenant == "A"], run.slo_s),
        "b_within_slo": share([o for o in storm if o.tenant == "B"], run.slo_s),
        "high_within_slo": share(high, run.slo_s),
        "low_within_slo": share(low, run.slo_s),
        "b_within_slo_prio_run": share([o for o in run.priority if o.tenant == "B"], run.slo_s),
        "ttft_p50_s": statistics.median(served) if served else float("nan"),
        "ttft_p99_s": sorted(served)[int(len(served) * 0.99)] if served else float("nan"),
        "refused_429": sum(o.status == 429 for o in refused),
        "refused_503": sum(o.status == 503 for o in refused),
        "other_errors": sum(o.status not in (0, 200, 429, 503) for o in storm + run.priority),
        "refusals_with_retry_after": len(with_retry) / len(refused) if refused else float("nan"),
        "refused_late": sum(o.refused_s > FAST_REFUSAL_S for o in refused),
        # Admitted on a forecast, but no worker had room in time (kvmesh's wording).
        "refused_expired": sum(o.reason.startswith("no worker had room") for o in refused),
        "refusal_p99_ms": sorted(o.refused_s for o in refused)[int(len(refused) * 0.99)] * 1000 if refused else 0.0,
        "refusals_within_50ms": (sum(o.refused_s <= FAST_REFUSAL_S for o in refused) / len(refused)
                                 if refused else float("nan")),
        "broken_streams": sum(o.broken or o.timed_out for o in storm + run.priority + run.one_x),
        "light_alone_ttft_ms": run.light_alone_s * 1000,
        "back_after_s": back_after_s(storm, run.light_alone_s),
    }


ROWS = [
    ("capacity X (completed requests/s)", "capacity_rps", "{:.1f}"),
    ("idle TTFT, ms", "idle_ttft_ms", "{:.0f}"),
    ("refused at 1 X", "one_x_refused", "{:.0f}"),
    ("good requests/s during the storm, over X", "goodput_over_x", "{:.2f}"),
    ("tenant A within SLO", "a_within_slo", "{:.2f}"),
    ("light tenant B within SLO", "b_within_slo", "{:.2f}"),
    ("priority run: high band within SLO", "high_within_slo", "{:.2f}"),
    ("priority run: A's low band within SLO", "low_within_slo", "{:.2f}"),
    ("priority run: B within SLO", "b_within_slo_prio_run", "{:.2f}"),
    ("served TTFT p50, s", "ttft_p50_s", "{:.2f}"),
    ("served TTFT p99, s", "ttft_p99_s", "{:.2f}"),
    ("refused 429 (both storms)", "refused_429", "{:.0f}"),
    ("refused 503 (both storms)", "refused_503", "{:.0f}"),
    ("other errors (not time-outs)", "other_errors", "{:.0f}"),
    ("refusals with Retry-After", "refusals_with_retry_after", "{:.2f}"),
    ("refusals within 50 ms", "refusals_within_50ms", "{:.2f}"),
    ("refusal latency p99, ms", "refusal_p99_ms", "{:.0f}"),
    ("refusals later than 50 ms", "refused_late", "{:.0f}"),
    ("of them: admitted, then no room in time", "refused_expired", "{:.0f}"),
    ("broken or timed-out streams", "broken_streams", "{:.0f}"),
    ("B alone: TTFT p50, ms", "light_alone_ttft_ms", "{:.0f}"),
    ("B back under 2x its TTFT alone after the storm, s", "back_after_s", "{:.1f}"),
]


def plot(runs: dict[str, list[Run]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), sharey=True, squeeze=False)
    for ax, (name, system_runs) in zip(axes[0], runs.items(), strict=True):
        run = system_runs[0]
        for tenant, colour in (("A", "tab:orange"), ("B", "tab:blue")):
            served = [o for o in run.storm if o.tenant == tenant and o.served]
            ax.scatter([o.sent_at for o in served], [o.ttft_s for o in served], s=3, c=colour, label=f"{tenant} served")
        refused = [o for o in run.storm if o.status in (429, 503)]
        ax.scatter([o.sent_at for o in refused], [0.0] * len(refused), s=3, c="tab:red", marker="|", label="refused")
        ax.axhline(run.slo_s, color="grey", linestyle="--", linewidth=0.8)
        ax.axvline(STORM_S, color="grey", linewidth=0.8)
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_title(name)
        ax.set_xlabel("sent at, s")
    axes[0][0].set_ylabel("TTFT, s (refused at 0)")
    axes[0][0].legend(loc="upper left", fontsize=7)
    return save_figure(fig, "overload_storm")


def run() -> None:
    systems = [System("kvmesh", kvmesh, objective_header=True),
               System("Dynamo 1.6.1 (defaults)", dynamo_serving(False)),
               System("Dynamo 1.6.1 (router queue)", dynamo_serving(True))]
    runs: dict[str, list[Run]] = {}
    for system in systems:
        print(f"overload: {system.name}")
        try:
            runs[system.name] = [measure(system, 100 * i) for i in range(REPEATS)]
        except dynamo.Unavailable as exc:
            print(f"  {system.name} left out: {exc}")
    names = list(runs)
    rows = [[label] + [median_range([r.figures[key] for r in runs[n]], fmt) for n in names] for label, key, fmt in ROWS]
    print(table(f"Overload: the same storm, median [range] of {REPEATS} runs each", ["", *names], rows))
    save_json("overload", {n: [r.figures for r in rs] for n, rs in runs.items()})
    print(f"plot: {plot(runs).relative_to(RESULTS.parent.parent)}")
