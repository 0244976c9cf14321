"""The planner's predictions against what each interval showed.

Every decision line gives the interval's observed mean TTFT and ITL and what the model said of
that same interval (its traffic, the sizes it had, the calibration before it): the model's error
with the traffic known. Printed per phase as the median of modelled / observed and the share of
intervals within 25%; per interval in the JSON and in planner_predictions.png.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from bench.planner.split import PlanLine
from bench.common.report import median, save_figure, table

WITHIN = 0.25


def intervals(plans: list[PlanLine], started_wall: float, phase_of: Callable[[float], str],
              duration_s: float) -> list[dict]:
    """One row per decision made during the load: when, which phase, observed and modelled."""
    rows = []
    for p in plans:
        at = p.at_wall - started_wall
        if not (0 < at <= duration_s + 5) or None in (*p.observed, *p.modelled):
            continue
        rows.append({"at_s": at, "phase": phase_of(min(at, duration_s)), "sizes": p.current,
                     "observed_ttft_s": p.observed[0], "modelled_ttft_s": p.modelled[0],
                     "observed_itl_s": p.observed[1], "modelled_itl_s": p.modelled[1]})
    return rows


def _ratios(rows: list[dict], what: str) -> list[float]:
    return [r[f"modelled_{what}_s"] / r[f"observed_{what}_s"] for r in rows
            if r[f"observed_{what}_s"] and math.isfinite(r[f"modelled_{what}_s"])]


def print_accuracy(runs: dict[str, list[dict]], phases: tuple[str, ...]) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = {}
    rows = []
    for name, ivs in runs.items():
        out[name] = {}
        for phase in (*phases, "overall"):
            mine = ivs if phase == "overall" else [r for r in ivs if r["phase"] == phase]
            cell = {}
            for what in ("ttft", "itl"):
                ratios = _ratios(mine, what)
                cell[f"{what}_median_ratio"] = median(ratios) if ratios else float("nan")
                cell[f"{what}_within"] = (sum(abs(x - 1) <= WITHIN for x in ratios) / len(ratios)
                                          if ratios else float("nan"))
            out[name][phase] = cell
            rows.append([name, phase, len(mine), f"{cell['ttft_median_ratio']:.2f}", f"{cell['ttft_within']:.0%}",
                         f"{cell['itl_median_ratio']:.2f}", f"{cell['itl_within']:.0%}"])
    table(f"Planner predictions vs observed, per interval (modelled / observed; share within {WITHIN:.0%})",
          ["run", "phase", "intervals", "TTFT median ratio", "TTFT within", "ITL median ratio", "ITL within"], rows)
    return out


def plot(runs: dict[str, list[dict]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(runs), figsize=(6 * len(runs), 6), squeeze=False)
    for col, (name, ivs) in enumerate(runs.items()):
        for row, what in enumerate(("ttft", "itl")):
            ax = axes[row][col]
            at = [r["at_s"] for r in ivs]
            ax.plot(at, [r[f"observed_{what}_s"] * 1000 for r in ivs], label="observed")
            ax.plot(at, [r[f"modelled_{what}_s"] * 1000 if math.isfinite(r[f"modelled_{what}_s"]) else float("nan")
                         for r in ivs], label="modelled", linestyle="--")
            ax.set_title(f"{name}: {what.upper()}")
            ax.set_ylabel("ms")
            ax.set_xlabel("seconds since the first request")
            ax.legend()
    return save_figure(fig, "planner_predictions")
