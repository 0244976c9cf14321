"""The report of the KV events part (kv_events.py): the table, the drill's timings, the goals, the plots
and the JSON; `run` measures and reports."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from bench.common.report import bar_plot, median, median_range, save_figure, save_json, table
from bench.routing.kv_events import (BLOCK_SIZE, DYNAMO, ENGAGE_GOAL_S, LOAD_S, NUM_GPU_BLOCKS, OUTPUT_TOKENS,
                                     PREFIX_WORDS, PREFIXES, RATE_PER_S, REUSE_TOLERANCE, SCENARIOS, SEEDS, SPEEDUP,
                                     SUFFIX_WORDS, WORKERS, ZIPF_S, Run, measure)


def run() -> dict:
    return report(*measure())


def _fmt_s(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"


def paired(runs: Sequence[Run], num: str, den: str, figure: str) -> list[float]:
    by = {(r.scenario, r.seed): r.figures()[figure] for r in runs}
    return [by[num, s] / by[den, s] for s in SEEDS if (num, s) in by and (den, s) in by and by[den, s]]


def goals(runs: Sequence[Run]) -> list[tuple[str, bool | None, str]]:
    """(goal, passed (None: not measured), the figures)."""
    reuse = {k: [r.figures()["reuse"] for r in runs if r.scenario == k] for k in SCENARIOS}
    out: list[tuple[str, bool | None, str]] = []
    if reuse["b"] and reuse["e"]:
        b, e = median(reuse["b"]), median(reuse["e"])
        out.append(("(b) reuse >= Dynamo --no-router-kv-events (e)", b >= e, f"{b:.1%} vs {e:.1%} (medians)"))
    else:
        out.append(("(b) reuse >= Dynamo --no-router-kv-events (e)", None, "Dynamo did not run"))
    ratios = paired(runs, "c", "a", "reuse")
    out.append((f"(c) reuse within {REUSE_TOLERANCE:.0%} of (a)", bool(ratios) and min(ratios) >= 1 - REUSE_TOLERANCE,
                "c/a per seed: " + " ".join(f"{x:.3f}" for x in ratios)))
    engaged = [r.engaged_after_s for r in runs if r.scenario == "c"]
    out.append((f"(c) fallback engaged within {ENGAGE_GOAL_S:g} s of the silence",
                bool(engaged) and all(e is not None and e <= ENGAGE_GOAL_S for e in engaged),
                "per seed: " + " ".join(_fmt_s(e) for e in engaged)))
    return out


def plot_drill(runs: Sequence[Run]) -> Path | None:
    drills = [r for r in runs if r.scenario == "c" and r.samples]
    if not drills:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(drills), figsize=(6.5 * len(drills), 6), sharex=True, squeeze=False)
    for col, r in enumerate(drills):
        top, bottom = axes[0][col], axes[1][col]
        for i, worker in enumerate(r.workers):
            label = f"{worker[:8]} (silenced)" if worker == r.silenced else worker[:8]
            style = {"linewidth": 2.2} if worker == r.silenced else {"linewidth": 1, "alpha": 0.7}
            acc = [(s.t_s, s.accuracy[worker]) for s in r.samples if worker in s.accuracy]
            if acc:
                top.plot(*zip(*acc), label=label, **style)
            src = [(s.t_s, s.source.get(worker, math.nan) + 0.03 * i) for s in r.samples]
            bottom.step(*zip(*src), where="post", label=label, **style)
        for ax in (top, bottom):
            for at, what, colour in ((r.silenced_at_s, "silenced", "red"), (r.published_at_s, "published", "green")):
                if at is not None:
                    ax.axvline(at, color=colour, linestyle="--", linewidth=1)
                    ax.text(at, ax.get_ylim()[1], f" {what}", color=colour, va="top", fontsize=8)
        top.set_title(f"seed {r.seed}: recent index accuracy per worker")
        top.set_ylabel("accuracy (last 32 requests)")
        top.set_ylim(0, 1.05)
        top.legend(fontsize=7)
        bottom.set_title("kv_source per worker (0 events, 1 predicted)")
        bottom.set_yticks([0, 1], ["events", "predicted"])
        bottom.set_xlabel("seconds after the load's start")
    return save_figure(fig, "routing_kv_events_drill")


def report(runs: Sequence[Run], skipped: str) -> dict:
    rows: list[list[object]] = []
    for key, (system, what) in SCENARIOS.items():
        mine = [r for r in runs if r.scenario == key]
        if not mine:
            rows.append([f"({key}) {system}", what, "-", "-", "not run", "-", "-"])
            continue
        figures = [r.figures() for r in mine]
        rows.append([f"({key}) {system}", what, " ".join(str(len(r.tally.ttft_ms)) for r in mine),
                     sum(r.tally.failures for r in mine),
                     median_range([100 * f["reuse"] for f in figures]) + " %",
                     median_range([f["ttft_p50_ms"] for f in figures], "{:.0f}"),
                     median_range([f["ttft_p99_ms"] for f in figures], "{:.0f}")])
    table(f"KV events on/off/silenced: {WORKERS} mocker workers x {NUM_GPU_BLOCKS} blocks, {PREFIXES} x "
          f"{PREFIX_WORDS}-word prefixes (Zipf {ZIPF_S:g}) + {SUFFIX_WORDS}-word suffixes, {RATE_PER_S:g} req/s "
          f"for {LOAD_S:g} s, seeds {' '.join(map(str, SEEDS))} (median [range] over seeds)",
          ["scenario", "routing", "done per seed", "failed", "reuse", "TTFT p50 ms", "TTFT p99 ms"], rows)
    drills = [r for r in runs if r.scenario == "c"]
    for r in drills:
        print(f"(c) seed {r.seed}: worker {r.silenced} silenced at {_fmt_s(r.silenced_at_s)}, fallback engaged after "
              f"{_fmt_s(r.engaged_after_s)}; published again at {_fmt_s(r.published_at_s)}, released after "
              f"{_fmt_s(r.released_after_s)}; switches: {', '.join(r.switch_reasons()) or 'none'}", flush=True)
    ttft = paired(runs, "c", "a", "ttft_p99_ms")
    print("(c)/(a) TTFT p99 per seed (shown, not a goal): " + " ".join(f"{x:.2f}" for x in ttft), flush=True)
    for r in runs:
        if r.system == DYNAMO and not r.usage_reports_cache:
            print(f"note: Dynamo ({r.scenario}) seed {r.seed}: no response reported cached tokens "
                  "(usage.prompt_tokens_details.cached_tokens absent or 0): its reuse reads 0", flush=True)
    results = goals(runs)
    for goal, passed, detail in results:
        verdict = "n/a" if passed is None else "PASS" if passed else "FAIL"
        print(f"goal: {goal}: {verdict} ({detail})", flush=True)
    if skipped:
        print(f"note: {skipped}", flush=True)
    plot = plot_drill(runs)
    labels = [f"({k})" for k in SCENARIOS if any(r.scenario == k for r in runs)]
    bar_plot("routing_kv_events_reuse", "Reuse by scenario (median over seeds, %)", labels,
             {"reuse %": [100 * median([r.figures()["reuse"] for r in runs if f"({r.scenario})" == label])
                          for label in labels]}, "%")
    data = {
        "settings": {"workers": WORKERS, "prefixes": PREFIXES, "prefix_words": PREFIX_WORDS,
                     "suffix_words": SUFFIX_WORDS, "zipf_s": ZIPF_S, "output_tokens": OUTPUT_TOKENS,
                     "num_gpu_blocks": NUM_GPU_BLOCKS, "block_size": BLOCK_SIZE, "speedup": SPEEDUP,
                     "rate_per_s": RATE_PER_S, "load_s": LOAD_S, "seeds": list(SEEDS)},
        "runs": [{"scenario": r.scenario, "system": r.system, "routing": SCENARIOS[r.scenario][1], "seed": r.seed,
                  "done": len(r.tally.ttft_ms), "failures": r.tally.failures, "prompt_tokens": r.tally.prompt_tokens,
                  "cached_tokens": r.tally.cached_tokens, "wall_s": r.wall_s, **r.figures(),
                  **({"silenced": r.silenced, "silenced_at_s": r.silenced_at_s, "engaged_after_s": r.engaged_after_s,
                      "published_at_s": r.published_at_s, "released_after_s": r.released_after_s,
                      "switches": r.switch_reasons(),
                      "samples": [{"t_s": s.t_s, "source": s.source, "accuracy": s.accuracy} for s in r.samples]}
                     if r.scenario == "c" else {})}
                 for r in runs],
        "goals": [{"goal": g, "passed": p, "figures": f} for g, p, f in results],
        "drill_plot": str(plot) if plot else None,
        "skipped": skipped,
    }
    save_json("routing_kv_events", data)
    return data
