"""One workload's tables, goals line and JSON section, from its runs (record.py's `Run`s)."""

from __future__ import annotations

from collections.abc import Sequence
from bench.common.report import median, median_range, table
from bench.lora.record import Case, Run

BASELINE = "blind"
GOAL_LOADS_RATIO = 0.2  # aware needs >= 5x fewer loads than blind
GOAL_P99_RATIO = 0.5
GOAL_REUSE_RATIO = 1.0
FIGURES = ("loads_per_1k", "ttft_p50_ms", "ttft_p99_ms", "reuse")


def paired_ratios(runs: Sequence[Run], seeds: Sequence[int], mode: str, figure: str) -> list[float]:
    by = {(r.mode, r.seed): r.figures()[figure] for r in runs}
    return [by[mode, s] / by[BASELINE, s] for s in seeds
            if (mode, s) in by and (BASELINE, s) in by and by[BASELINE, s]]


def goals(runs: Sequence[Run], seeds: Sequence[int]) -> dict[str, dict[str, float | bool]]:
    loads = median(paired_ratios(runs, seeds, "aware", "loads_per_1k"))
    p99 = median(paired_ratios(runs, seeds, "aware", "ttft_p99_ms"))
    reuse = median(paired_ratios(runs, seeds, "aware", "reuse"))
    return {"loads >= 5x fewer": {"ratio": loads, "met": loads <= GOAL_LOADS_RATIO},
            "TTFT p99 <= 0.5x": {"ratio": p99, "met": p99 <= GOAL_P99_RATIO},
            "reuse no lower": {"ratio": reuse, "met": reuse >= GOAL_REUSE_RATIO}}


def floors(runs: Sequence[Run]) -> list[float]:
    """The floor of each seed (the modes of one seed share their requests, so one mode's runs say it)."""
    return [r.floor_per_1k() for r in runs if r.mode == BASELINE]


def report(case: Case, runs: Sequence[Run], modes: Sequence[str], workers: int, max_loras: int,
           seconds: float) -> dict:
    """Prints the case's tables and goals line; its section of the JSON."""
    w = case.workload
    rows: list[list[object]] = []
    for mode in modes:
        mine = [r for r in runs if r.mode == mode]
        figures = [r.figures() for r in mine]
        rows.append([mode, " ".join(str(len(r.measured.done)) for r in mine), sum(r.measured.failures for r in mine),
                     median_range([f["loads_per_1k"] for f in figures], "{:.0f}"),
                     median_range([f["ttft_p50_ms"] for f in figures], "{:.0f}"),
                     median_range([f["ttft_p99_ms"] for f in figures], "{:.0f}"),
                     median_range([100 * f["reuse"] for f in figures]) + " %"])
    for mode in modes:
        if mode != BASELINE:
            rows.append([f"{mode} / {BASELINE}", "", "",
                         *(median_range(paired_ratios(runs, case.seeds, mode, f), "{:.2f}") for f in FIGURES)])
    rows.append([f"floor (optimal, {workers * max_loras} slots)", "", "",
                 median_range(floors(runs), "{:.0f}"), "", "", ""])
    table(f"LoRA placement, {case.title}: {workers} mocker workers, --max-loras {max_loras}, {w.adapters} adapters "
          f"(Zipf {w.zipf_s:g}, {w.adapter_bytes / 1e6:.0f} MB each), {w.prefix_tokens}-token "
          f"system prefix + {w.user_tokens}-token user part (prefix overlap term {case.overlap_term():.2f}), "
          f"{w.output_tokens} output tokens, {w.rate_per_s:g} req/s; {w.requests} measured requests after "
          f"{w.warmup_requests} warm-up, seeds {', '.join(map(str, case.seeds))} (median [min-max]; ratios "
          f"paired per seed)",
          ["mode", "done per run", "failed", "loads / 1k req", "TTFT p50 ms", "TTFT p99 ms", "prefix reuse"], rows)
    groups = list(case.popularity_groups())
    table(f"Where the loads are, {case.title} (median over seeds): loads per 1k requests by adapter popularity "
          "rank; workers that served each of the 4 hottest adapters; distinct adapters each worker served",
          ["mode", *(f"loads {g}" for g in groups), "workers per top-4 adapter", "adapters per worker"],
          [[mode, *(f"{median([r.loads_by_group()[g] for r in runs if r.mode == mode]):.0f}" for g in groups),
            f"{median([r.workers_per_hot_adapter() for r in runs if r.mode == mode]):.1f}",
            f"{median([r.adapters_per_worker() for r in runs if r.mode == mode]):.1f}"] for mode in modes])
    met = goals(runs, case.seeds)
    print(f"goals, {case.title} (aware / blind, median of paired ratios): "
          + "; ".join(f"{name}: {g['ratio']:.2f} {'met' if g['met'] else 'NOT met'}" for name, g in met.items())
          + f" ({seconds:.0f} s)", flush=True)
    return {"title": case.title, "workload": {**w.__dict__, "adapter_bytes": w.adapter_bytes},
            "overlap_term": case.overlap_term(), "seeds": list(case.seeds), "seconds": round(seconds, 1),
            "runs": [r.to_json() for r in runs],
            "ratios_over_baseline": {m: {f: paired_ratios(runs, case.seeds, m, f) for f in FIGURES}
                                     for m in modes if m != BASELINE},
            "goals": met}
