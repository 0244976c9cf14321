"""bench/results/agents_sessions.png: the CDF of later turns' TTFT per mode (one line per seed), and the
reused share of the ideal by turn number."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bench.agents.record import Run
from bench.agents.run_figures import later_ttfts
from bench.common.report import save_figure


def _reuse_by_turn(run: Run) -> tuple[list[int], list[float]]:
    cached: dict[int, int] = {}
    ideal: dict[int, int] = {}
    for o in run.driven.turns():
        if o.ok and o.turn > 0:
            cached[o.turn] = cached.get(o.turn, 0) + o.cached_tokens
            ideal[o.turn] = ideal.get(o.turn, 0) + o.ideal_cached
    turns = sorted(k for k in ideal if ideal[k])
    return [k + 1 for k in turns], [cached[k] / ideal[k] for k in turns]


def plot(runs: Sequence[Run], modes: Sequence[str], name: str = "agents_sessions",
         title: str = "Agent sessions: session affinity + KV retention vs plain kv routing") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, by_turn) = plt.subplots(1, 2, figsize=(13, 4.5))
    for i, mode in enumerate(modes):
        for n, r in enumerate(x for x in runs if x.mode == mode):
            label = mode if n == 0 else None
            ttfts = later_ttfts(r.driven)
            if ttfts:
                cdf.plot(ttfts, [(k + 1) / len(ttfts) for k in range(len(ttfts))], color=f"C{i}", alpha=0.8,
                         label=label)
            turns, shares = _reuse_by_turn(r)
            by_turn.plot(turns, shares, color=f"C{i}", marker="o", markersize=3, alpha=0.8, label=label)
    cdf.set_xscale("log")
    cdf.set_xlabel("TTFT of turns after the first (ms, log)")
    cdf.set_ylabel("share of turns")
    cdf.axhline(0.99, color="k", linestyle=":", linewidth=1)
    cdf.set_title("Later turns' TTFT (one line per seed; dotted: p99)")
    cdf.legend()
    by_turn.set_xlabel("turn")
    by_turn.set_ylabel("cached / ideal tokens")
    by_turn.set_ylim(0, 1.05)
    by_turn.set_title("Reused share of the ideal by turn")
    by_turn.legend()
    fig.suptitle(title)
    return save_figure(fig, name)
