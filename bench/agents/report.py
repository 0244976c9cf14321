"""The benchmark's tables, goals line and JSON section, from its runs (record.py's `Run`s): each figure as the median
of the seeds with their range, and the sessions mode's ratios to plain kv routing paired per seed."""

from __future__ import annotations

from collections.abc import Sequence

from bench.agents.record import Run
from bench.agents.run_figures import LOST_BELOW
from bench.agents.workload import AgentWorkload
from bench.common.report import median, median_range, table

BASELINE = "plain-kv"
MODE = "sessions"
GOAL_REUSE_OVER_IDEAL = 0.9
GOAL_P99_RATIO = 0.5
RATIO_FIGURES = ("reuse_later", "ttft_later_p50_ms", "ttft_later_p99_ms", "background_ttft_p50_ms")


def paired_ratios(runs: Sequence[Run], seeds: Sequence[int], mode: str, figure: str) -> list[float]:
    by = {(r.mode, r.seed): r.figures()[figure] for r in runs}
    pairs = [(by[mode, s], by[BASELINE, s]) for s in seeds if (mode, s) in by and (BASELINE, s) in by]
    return [a / b for a, b in pairs if b and a == a and b == b]  # NaN: nothing measured


def _values(runs: Sequence[Run], mode: str, figure: str, scale: float = 1.0) -> list[float]:
    values = (r.figures()[figure] for r in runs if r.mode == mode)
    return [scale * v for v in values if v == v]  # NaN (nothing to measure) left out


def _pct(runs: Sequence[Run], mode: str, figure: str) -> str:
    return median_range(_values(runs, mode, figure, 100.0)) + " %"


def goals(runs: Sequence[Run], seeds: Sequence[int], mode: str = MODE) -> dict[str, dict[str, float | bool]]:
    reuse = median(_values(runs, mode, "reuse_over_ideal"))
    p99 = median(paired_ratios(runs, seeds, mode, "ttft_later_p99_ms"))
    return {f"reuse >= {GOAL_REUSE_OVER_IDEAL:g} of ideal": {"value": reuse, "met": reuse >= GOAL_REUSE_OVER_IDEAL},
            f"later-turn TTFT p99 <= {GOAL_P99_RATIO:g}x {BASELINE}": {"value": p99, "met": p99 <= GOAL_P99_RATIO}}


def _compared(modes: Sequence[str]) -> list[str]:
    """The modes set against the baseline (none when the baseline did not run)."""
    return [m for m in modes if m != BASELINE] if BASELINE in modes else []


def _reuse_table(runs: Sequence[Run], modes: Sequence[str], seeds: Sequence[int], title: str) -> None:
    rows: list[list[object]] = []
    for mode in modes:
        mine = [r for r in runs if r.mode == mode]
        rows.append([mode, " ".join(f"{r.figures()['turns_done']:.0f}" for r in mine),
                     sum(int(r.figures()["turns_failed"]) for r in mine),
                     _pct(runs, mode, "reuse_later"), _pct(runs, mode, "ideal_later"),
                     median_range(_values(runs, mode, "reuse_over_ideal"), "{:.2f}"),
                     *(_pct(runs, mode, f) for f in ("reuse_all", "ideal_all", "lost_share", "from_host_share",
                                                     "moved_share"))])
    for mode in _compared(modes):
        rows.append([f"{mode} / {BASELINE}", "", "", median_range(paired_ratios(runs, seeds, mode, "reuse_later"), "{:.2f}"),
                     "", median_range(paired_ratios(runs, seeds, mode, "reuse_over_ideal"), "{:.2f}"),
                     "", "", "", "", ""])
    table(title, ["mode", "turns done per run", "failed", "reuse, later turns", "ideal, later", "reuse / ideal",
                  "reuse, all turns", "ideal, all", f"prefix lost (< {LOST_BELOW:g} of ideal)", "reused from host",
                  "turn moved worker"], rows)


def _latency_table(runs: Sequence[Run], modes: Sequence[str], seeds: Sequence[int]) -> None:
    ms = lambda mode, figure: median_range(_values(runs, mode, figure), "{:.0f}")  # noqa: E731
    rows: list[list[object]] = []
    for mode in modes:
        rows.append([mode, ms(mode, "ttft_later_p50_ms"), ms(mode, "ttft_later_p99_ms"), ms(mode, "ttft_first_p50_ms"),
                     ms(mode, "ttft_kept_p50_ms"), ms(mode, "ttft_lost_p50_ms"), ms(mode, "ttft_kept_p99_ms"),
                     " ".join(f"{r.figures()['background_done']:.0f}/{r.figures()['background_failed']:.0f}"
                              for r in runs if r.mode == mode),
                     ms(mode, "background_ttft_p50_ms"), ms(mode, "background_ttft_p99_ms")])
    for mode in _compared(modes):
        ratio = [median_range(paired_ratios(runs, seeds, mode, f), "{:.2f}") for f in
                 ("ttft_later_p50_ms", "ttft_later_p99_ms", "ttft_first_p50_ms", "ttft_kept_p50_ms", "ttft_kept_p99_ms",
                  "background_ttft_p50_ms", "background_ttft_p99_ms")]
        rows.append([f"{mode} / {BASELINE}", *ratio[:4], "", ratio[4], "", *ratio[5:]])
    table("TTFT in ms: later turns (after each session's first), first turns, later turns whose prefix was kept or "
          "lost, and the background (done/failed per run)",
          ["mode", "later p50", "later p99", "first p50", "kept p50", "lost p50", "kept p99", "background done/failed",
           "background p50", "background p99"], rows)


def report(runs: Sequence[Run], modes: Sequence[str], seeds: Sequence[int], w: AgentWorkload, seconds: float,
           mesh: str, sessions: str | None = None) -> dict:
    """Prints the tables and the goals line; the JSON section. `sessions`: what the sessions were,
    when not the synthetic trace of `w` (its background is `w`'s all the same)."""
    sessions = sessions or (f"{w.sessions} sessions of {w.min_turns}-{w.max_turns} turns, each appending "
                            f"{w.min_append}-{w.max_append} tokens, tool gaps {w.min_gap_s:g}-{w.max_gap_s:g} s "
                            "(log-uniform)")
    _reuse_table(runs, modes, seeds,
                 f"Agent sessions: {sessions}; background {w.background_rate_per_s:g}/s prompts of "
                 f"{w.min_background_prompt}-{w.max_background_prompt} tokens; {mesh}; seeds "
                 f"{', '.join(map(str, seeds))} (median [min-max]; ratios paired per seed)")
    _latency_table(runs, modes, seeds)
    met = {mode: goals(runs, seeds, mode) for mode in _compared(modes) or [MODE]}
    for mode, g in met.items():
        print(f"goals ({mode} vs {BASELINE}, median over seeds): "
              + "; ".join(f"{name}: {x['value']:.2f} {'met' if x['met'] else 'NOT met'}" for name, x in g.items())
              + f" ({seconds:.0f} s)", flush=True)
    return {"workload": dict(w.__dict__), "seeds": list(seeds), "seconds": round(seconds, 1),
            "runs": [r.to_json() for r in runs],
            "ratios_over_baseline": {m: {f: paired_ratios(runs, seeds, m, f) for f in RATIO_FIGURES}
                                     for m in modes if m != BASELINE},
            "goals": met}
