"""Shared output of the benchmarks: aligned tables on stdout, JSON and PNG plots under bench/results/."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.profiles.stats import percentile

__all__ = ["percentile", "median", "table", "save_json", "bar_plot"]

RESULTS = Path(__file__).resolve().parents[1] / "results"


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def median_range(values: Sequence[float], fmt: str = "{:.1f}") -> str:
    """Repeated runs in a table cell: the median, and the lowest and highest in brackets."""
    if not values:
        return "-"
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda items: "| " + " | ".join(s.rjust(w) for s, w in zip(items, widths)) + " |"
    out = [f"\n{title}", line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells]
    text = "\n".join(out)
    print(text, flush=True)
    return text


def _fmt(value: object) -> str:
    if isinstance(value, float):
        if value != value:
            return "-"
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"
    return str(value)


def save_json(name: str, data: object) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=1))
    return path


def bar_plot(name: str, title: str, groups: Sequence[str], series: dict[str, Sequence[float]], ylabel: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        xs = [g + i * width for g in range(len(groups))]
        ax.bar(xs, values, width, label=label)
    ax.set_xticks([g + width * (len(series) - 1) / 2 for g in range(len(groups))], groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    return save_figure(fig, name)


def save_figure(fig: Any, name: str) -> Path:
    """Writes a matplotlib figure to bench/results/<name>.png and closes it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
