"""bench/results/lora_placement.png: loads, TTFT and reuse per mode, one row per workload, the median of the seeds
with their range."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common.report import save_figure
from bench.lora.record import Run

# A workload's row: its title, its runs, the floor of each of its seeds.
Panel = tuple[str, Sequence[Run], Sequence[float]]


def _bar(ax: Any, x: float, values: Sequence[float], width: float, color: str, label: str | None = None) -> None:
    mid = statistics.median(values)
    ax.bar([x], [mid], width, yerr=[[mid - min(values)], [max(values) - mid]], capsize=3, color=color, label=label)


def _row(axes: Sequence[Any], title: str, runs: Sequence[Run], modes: Sequence[str], floors: Sequence[float]) -> None:
    loads, ttft, reuse = axes
    for i, mode in enumerate(modes):
        figures = [r.figures() for r in runs if r.mode == mode]
        if not figures:
            continue
        _bar(loads, i, [f["loads_per_1k"] for f in figures], 0.6, "C0")
        _bar(ttft, i - 0.2, [f["ttft_p50_ms"] for f in figures], 0.4, "C0", "p50" if i == 0 else None)
        _bar(ttft, i + 0.2, [f["ttft_p99_ms"] for f in figures], 0.4, "C1", "p99" if i == 0 else None)
        _bar(reuse, i, [100 * f["reuse"] for f in figures], 0.6, "C2")
    if floors:
        loads.axhline(statistics.median(floors), color="k", linestyle="--", linewidth=1, label="floor (optimal)")
        loads.legend()
    for ax, name, unit in ((loads, "Adapter loads per 1,000 requests", "loads"), (ttft, "TTFT", "ms"),
                           (reuse, "Prefix reuse", "% of prompt tokens")):
        ax.set_xticks(range(len(modes)), list(modes))
        ax.set_title(f"{title}: {name}")
        ax.set_ylabel(unit)
    ttft.legend()


def plot(panels: Sequence[Panel], modes: Sequence[str]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 3, figsize=(13, 4 * len(panels)), squeeze=False)
    for row, (title, runs, floors) in zip(axes, panels):
        _row(row, title, runs, modes, floors)
    fig.suptitle("LoRA placement (median of seeds, bars: min-max)")
    return save_figure(fig, "lora_placement")
