"""What the chaos run prints: the summary table, the fault schedule, and every failure grouped
by its message next to the fault that came just before it, so a failure class points at a fault
and at the service logs to read."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field

from bench.chaos.faults import Fault
from bench.chaos.load import Load, Outcome, Verdict
from bench.chaos.faults import ROLL
from bench.chaos.metrics import (FALLBACKS, HANDOFFS, LOCAL, MIGRATIONS, RECOMPUTED, REMOTE, WORKER_FAILURES,
                                 MetricsWatcher)
from bench.chaos.procs import Leftover
from bench.common.report import table

SUMMARY = ["sent", "completed", "failed", "corrupted", "migrated", "handed over", "fell back to local prefill",
           "retried"]


@dataclass
class Summary:
    sent: int
    completed: int
    failed: int
    corrupted: int
    unverified: int
    migrated: int
    fallbacks: int
    retried: int
    # Handed over by a draining decode worker (the roll), with their KV where it held any.
    handed_over: int = 0
    reasons: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.reasons


def summarize(load: Load, verdict: Verdict, metrics: MetricsWatcher, faults: list[Fault],
              process_problems: list[str], orphans: list[Leftover]) -> Summary:
    completed = sum(1 for o in load.outcomes if o.completed)
    failed = load.sent - completed  # sent with no outcome at all (still streaming at the deadline) failed too
    migrated = int(metrics.total(MIGRATIONS))
    s = Summary(load.sent, completed, failed, len(verdict.corrupted), len(verdict.unverified), migrated,
                int(metrics.total(FALLBACKS)), max(0, int(metrics.total(WORKER_FAILURES)) - migrated),
                int(metrics.total(HANDOFFS)))
    for count, what in ((s.failed, "failed"), (s.corrupted, "corrupted"), (s.unverified, "unverifiable"),
                        (len(orphans), "orphaned processes"),
                        (len(process_problems), "processes that exited unasked or not 0 on SIGTERM")):
        if count:
            s.reasons.append(f"{count} {what}")
    if s.completed == 0:
        s.reasons.append("no request completed")
    for f in faults:
        if f.kind == ROLL and "no move step" in f.note:
            s.reasons.append("the rolled decode worker's drain did not run its move step")
    s.reasons += [f"fault {f.kind}: {f.note}" for f in faults if not f.ok]
    s.reasons += [f"fault {f.kind} never ran (the schedule overran)" for f in faults if f.started_s is None]
    return s


def print_report(s: Summary, load: Load, verdict: Verdict, metrics: MetricsWatcher, faults: list[Fault],
                 names: dict[str, str], process_problems: list[str], orphans: list[Leftover]) -> None:
    table("Chaos run", SUMMARY, [[s.sent, s.completed, s.failed, s.corrupted, s.migrated, s.handed_over, s.fallbacks,
                                  s.retried]])
    print(f"counters: the last scrape of {metrics.instances('processor')} processor and "
          f"{metrics.instances('decode-worker')} decode-worker instances over {metrics.scrapes} scrapes, summed; they "
          "reset with each process, and what a killed instance counted after its last scrape is lost. "
          "retried = worker failures - migrations (no retry counter is exported). "
          f"tokens recomputed for requests taken mid-stream (migrations): {metrics.total(RECOMPUTED):.0f}. "
          f"fallback reasons: {_fmt_counts(metrics.fallback_reasons())}; decode prefills remote "
          f"{metrics.total(REMOTE):.0f} / local {metrics.total(LOCAL):.0f}.")
    print(f"headers of answered requests: prefill {_fmt_counts(_prefill_kinds(load.outcomes))}; decode workers "
          f"{_fmt_counts(Counter(names.get(o.worker, o.worker or '-') for o in load.outcomes))}.")
    print(f"verification: {verdict.references} distinct requests re-sent once to the settled mesh; "
          f"{s.unverified} completed streams had no reference.")
    table("Fault schedule (seconds since the load started)",
          ["#", "fault", "planned", "started", "ended", "victim", "replacement", "note"],
          [[i + 1, f.kind, f.planned_s, _t(f.started_s), _t(f.ended_s), f.victim, f.replacement,
            ("" if f.ok else "FAILED: ") + f.note] for i, f in enumerate(faults)])
    _print_failures(load, faults, names)
    for o, why in verdict.corrupted[:10]:
        print(f"corrupted: request key {o.key} sent {o.sent_s}s on {names.get(o.worker, o.worker)} "
              f"({o.prefill}): {why}")
    for line in process_problems:
        print(f"process: {line}")
    for left in orphans:
        print(f"orphan: pid {left.pid} ({left.why}): {left.cmdline}")


def _print_failures(load: Load, faults: list[Fault], names: dict[str, str]) -> None:
    failed = [o for o in load.outcomes if not o.completed]
    missing = load.sent - len(load.outcomes)
    if not failed and not missing:
        return
    groups: dict[str, list[Outcome]] = {}
    for o in failed:
        groups.setdefault(_normalized(o.error), []).append(o)
    rows = []
    for message, items in sorted(groups.items(), key=lambda kv: kv[1][0].sent_s):
        workers = Counter(names.get(o.worker, o.worker or "no header") for o in items)
        rows.append([len(items), f"{min(o.sent_s for o in items)}-{max(o.ended_s for o in items)}",
                     _fault_before(faults, min(o.ended_s for o in items)), _fmt_counts(workers), message[:150]])
    if missing:
        rows.append([missing, "-", "-", "-", "no outcome: still streaming when the load's deadline passed"])
    table("Failures by message (sent-ended s; the last fault started before the first one ended)",
          ["count", "window s", "last fault before", "decode worker", "error"], rows)


def _normalized(error: str) -> str:
    """The message with ids and numbers blanked, so one failure class is one row."""
    return re.sub(r"\b[0-9a-f]{8,}\b|(?<!HTTP )\b\d+(\.\d+)?", "#", error)


def _fault_before(faults: list[Fault], at: float) -> str:
    started = [f for f in faults if f.started_s is not None and f.started_s <= at]
    if not started:
        return "none"
    f = max(started, key=lambda f: f.started_s or 0.0)
    return f"{f.kind} at {f.started_s}s"


def _prefill_kinds(outcomes: list[Outcome]) -> Counter[str]:
    return Counter(o.prefill.split(":")[0] if o.prefill else "-" for o in outcomes)


def _fmt_counts(counts: dict[str, float] | Counter[str]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(counts.items())) or "none"


def _t(value: float | None) -> str:
    return "-" if value is None else f"{value}"


def result_line(s: Summary, run_dir: str) -> str:
    """One machine-readable line for scripts and the test suite."""
    return "CHAOS_RESULT " + json.dumps({"sent": s.sent, "completed": s.completed, "failed": s.failed,
                                         "corrupted": s.corrupted, "unverified": s.unverified,
                                         "migrated": s.migrated, "fallbacks": s.fallbacks, "retried": s.retried,
                                         "passed": s.passed, "reasons": s.reasons, "run_dir": run_dir})
