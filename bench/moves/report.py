"""The moves run's output: the table of every figure per system (median [range] of the repeats),
the move's ratios against the baselines of the same run, the goals with PASS/FAIL, a PNG and a
JSON under bench/results/ (names starting with "moves")."""

from __future__ import annotations

import math
from collections.abc import Sequence

from bench.common.report import RESULTS, median, median_range, save_figure, save_json, table
from bench.moves.load import CLIENTS, MAX_PROMPT, MAX_TOKENS, MIN_PROMPT
from bench.moves.mesh import KV_BYTES_PER_TOKEN, SPEEDUP

Runs = dict[str, list[dict[str, float]]]
MOVE = "move"

ROWS = [
    ("steady goodput, output tokens/s", "steady_tok_s", "{:.0f}"),
    ("requests completed in the steady window", "steady_requests", "{:.0f}"),
    ("goodput during the roll / steady", "goodput_ratio", "{:.2f}"),
    ("roll window (3 workers, + 3 s), s", "roll_s", "{:.1f}"),
    ("tokens recomputed (processor)", "recomputed_tokens", "{:.0f}"),
    ("handoffs (processor)", "handoffs", "{:.0f}"),
    ("migrations (processor; Dynamo: re-routes in its log)", "migrations", "{:.0f}"),
    ("handed over (drained workers' lines)", "handed_over", "{:.0f}"),
    ("moved in with KV pulled (destinations)", "moved_in_pulled", "{:.0f}"),
    ("moved in, KV recomputed (destinations)", "moved_in_recomputed", "{:.0f}"),
    ("streams on a rolled worker at its SIGTERM", "moved_streams", "{:.0f}"),
    ("  of them given up mid-stream (moved or migrated)", "given_up_mid_stream", "{:.0f}"),
    ("  their longest gap p50, ms", "gap_ms_p50", "{:.0f}"),
    ("  their longest gap p99, ms", "gap_ms_p99", "{:.0f}"),
    ("  their longest gap max, ms", "gap_ms_max", "{:.0f}"),
    ("  longest gap within the drain p50, ms", "drain_gap_ms_p50", "{:.0f}"),
    ("  longest gap within the drain max, ms", "drain_gap_ms_max", "{:.0f}"),
    ("  given up mid-stream: processor's line to next chunk p50, ms", "resumed_ms_p50", "{:.0f}"),
    ("  given up mid-stream: processor's line to next chunk max, ms", "resumed_ms_max", "{:.0f}"),
    ("steady window: longest gap per stream p99, ms", "steady_gap_ms_p99", "{:.0f}"),
    ("steady window: longest gap per stream max, ms", "steady_gap_ms_max", "{:.0f}"),
    ("KV pulls of the roll (destinations)", "kv_pulls", "{:.0f}"),
    ("  KV pull p50, ms", "kv_pull_p50_ms", "{:.1f}"),
    ("  KV pull max (bucket bound), ms", "kv_pull_max_ms", "{:.1f}"),
    ("  KV pulled, MiB", "kv_pulled_mib", "{:.0f}"),
    ("SIGTERM to exit p50, s", "exit_s_p50", "{:.2f}"),
    ("SIGTERM to exit max, s", "exit_s_max", "{:.2f}"),
    ("handover (drain line) max, s", "handover_s_max", "{:.2f}"),
    ("old workers killed past the exit limit", "killed", "{:.0f}"),
    ("requests", "requests", "{:.0f}"),
    ("errors", "errors", "{:.0f}"),
    ("not exact (tokens != max_tokens, or error)", "inexact", "{:.0f}"),
]

# The move against each baseline: ratio of the medians (lower is better but for goodput).
RATIOS = [
    ("tokens recomputed", "recomputed_tokens"),
    ("longest gap of a moved stream, max", "gap_ms_max"),
    ("longest gap within the drain, max", "drain_gap_ms_max"),
    ("given up mid-stream: line to next chunk, max", "resumed_ms_max"),
    ("SIGTERM to exit p50", "exit_s_p50"),
    ("SIGTERM to exit max", "exit_s_max"),
    ("goodput during the roll / steady", "goodput_ratio"),
]


def _values(runs: Runs, name: str, key: str) -> list[float]:
    return [r[key] for r in runs.get(name, []) if not math.isnan(r.get(key, math.nan))]


def one_line(f: dict[str, float]) -> str:
    return (f"steady {f['steady_tok_s']:.0f} tok/s, roll/steady {f['goodput_ratio']:.2f}, recomputed "
            f"{f['recomputed_tokens']:.0f}, handoffs {f['handoffs']:.0f}, migrations {f['migrations']:.0f}, "
            f"moved streams {f['moved_streams']:.0f} (gap max {f['gap_ms_max']:.0f} ms, in drain "
            f"{f['drain_gap_ms_max']:.0f} ms, given up mid-stream {f['given_up_mid_stream']:.0f}, resumed max "
            f"{f['resumed_ms_max']:.0f} ms), KV pulls {f['kv_pulls']:.0f} (p50 {f['kv_pull_p50_ms']:.1f} ms), "
            f"exit p50 {f['exit_s_p50']:.2f} s, errors {f['errors']:.0f}, inexact {f['inexact']:.0f}")


def _ratio(runs: Runs, key: str, baseline: str) -> str:
    mine, theirs = median(_values(runs, MOVE, key)), median(_values(runs, baseline, key))
    if math.isnan(mine) or math.isnan(theirs):
        return "-"
    if theirs == 0:
        return "0/0" if mine == 0 else "inf"
    return f"{mine / theirs:.2f}x"


def _goal_rows(runs: Runs) -> list[list[object]]:
    """Each goal on each repeat of the move mode: the measured value, and PASS only when every
    repeat meets it."""
    moves = runs.get(MOVE, [])

    def row(goal: str, target: str, shown: Sequence[str], met: Sequence[bool]) -> list[object]:
        return [goal, target, *shown, "PASS" if met and all(met) else "FAIL"]

    rows = [
        row("tokens recomputed for moved requests", "= 0", [f"{r['recomputed_tokens']:.0f}" for r in moves],
            [r["recomputed_tokens"] == 0 for r in moves]),
        row("longest gap of a moved stream", "<= 2 x longest KV pull",
            [f"{r['gap_ms_max']:.0f} vs 2 x {r['kv_pull_max_ms']:.1f} ms" for r in moves],
            [r["gap_ms_max"] <= 2 * r["kv_pull_max_ms"] for r in moves]),
        row("  (the same, gaps within the drain only)", "<= 2 x longest KV pull",
            [f"{r['drain_gap_ms_max']:.0f} vs 2 x {r['kv_pull_max_ms']:.1f} ms" for r in moves],
            [r["drain_gap_ms_max"] <= 2 * r["kv_pull_max_ms"] for r in moves]),
        row("  (its move's own part: handoff line to next chunk)", "<= 2 x longest KV pull",
            [f"{r['resumed_ms_max']:.0f} vs 2 x {r['kv_pull_max_ms']:.1f} ms" for r in moves],
            [r["resumed_ms_max"] <= 2 * r["kv_pull_max_ms"] for r in moves]),
        row("goodput during the roll", ">= 0.9 x steady", [f"{r['goodput_ratio']:.2f}" for r in moves],
            [r["goodput_ratio"] >= 0.9 for r in moves]),
        row("errors", "= 0", [f"{r['errors']:.0f}" for r in moves], [r["errors"] == 0 for r in moves]),
        row("exactness (completion_tokens == max_tokens)", "every stream",
            [f"{r['requests'] - r['inexact']:.0f}/{r['requests']:.0f}" for r in moves],
            [r["inexact"] == 0 for r in moves]),
    ]
    return rows


def plot(runs: Runs) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("longest gap of a moved stream, max (ms)", "gap_ms_max", True),
              ("given up mid-stream: line to next chunk, max (ms)", "resumed_ms_max", True),
              ("SIGTERM to exit, p50 (s)", "exit_s_p50", False),
              ("goodput during the roll / steady", "goodput_ratio", False),
              ("tokens recomputed", "recomputed_tokens", False)]
    names = [n for n in runs if runs[n]]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4))
    for ax, (title, key, log) in zip(axes, panels, strict=True):
        for x, name in enumerate(names):
            vals = _values(runs, name, key)
            if not vals:  # not measured (Dynamo exports no such counter; nothing was given up)
                ax.text(x, 0.02, "n/a", ha="center", va="bottom", fontsize=8, transform=ax.get_xaxis_transform())
                continue
            m = median(vals)
            ax.bar(x, m, yerr=[[m - min(vals)], [max(vals) - m]], capsize=3, color="tab:blue")
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
        ax.set_xlim(-0.5, len(names) - 0.5)
        ax.set_title(title, fontsize=9)
        if log:
            ax.set_yscale("log")
    fig.suptitle("Rolling restart of 3 decode workers under agent sessions of 8k-64k tokens (median, range of repeats)")
    return str(save_figure(fig, "moves").relative_to(RESULTS.parent.parent))


def report(runs: Runs, notes: dict[str, str], wall_s: float, streams: dict[str, list[object]]) -> None:
    """Prints the tables and writes the JSON (with `streams`: each moved stream's detail, per
    system and repeat) and the plot."""
    names = list(runs)
    repeats = max(len(v) for v in runs.values())
    heads = [n if runs[n] or n not in notes else f"{n} ({notes[n]})" for n in names]
    rows = [[label] + [median_range(_values(runs, n, key), fmt) if runs[n] else "-" for n in names]
            for label, key, fmt in ROWS]
    table(f"Rolling restart of every decode worker under load, median [range] of {repeats} runs each "
          f"({CLIENTS} agent sessions of {MIN_PROMPT // 1024}k-{MAX_PROMPT // 1024}k tokens, {MAX_TOKENS} out, "
          f"mocker at speedup {SPEEDUP:g}, {KV_BYTES_PER_TOKEN} KV bytes/token)", ["", *heads], rows)
    for name, why in notes.items():
        print(f"{name}: {why}")
    baselines = [n for n in names if n != MOVE]
    table("move against the baselines of the same run (ratio of medians)", ["", *(f"move / {b}" for b in baselines)],
          [[label] + [_ratio(runs, key, b) for b in baselines] for label, key in RATIOS])
    moves = runs.get(MOVE, [])
    table("Goals (move mode; PASS only if every repeat meets it)",
          ["goal", "target", *(f"repeat {i + 1}" for i in range(len(moves))), "result"], _goal_rows(runs))
    path = save_json("moves", {"runs": runs, "notes": notes, "wall_s": wall_s, "moved_streams": streams,
                               "setting": {"clients": CLIENTS, "prompt_tokens": [MIN_PROMPT, MAX_PROMPT],
                                           "max_tokens": MAX_TOKENS, "speedup": SPEEDUP,
                                           "kv_bytes_per_token": KV_BYTES_PER_TOKEN}})
    print(f"JSON: {path.relative_to(RESULTS.parent.parent)}; plot: {plot(runs)}; wall time {wall_s / 60:.1f} min")
