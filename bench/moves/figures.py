"""The figures of one run (a drain mode, a repeat): what the clients saw in the steady window and
during the roll, what the processor counted, what the destinations pulled and how long each old
worker took to go.

The streams a roll moved are those running at an old worker's SIGTERM that were on it: routed
there (the x-kvmesh-worker header), or given up by it according to the processor's log (a
stream that had moved there from a worker rolled before). Their gap is the longest wait between
two chunks, over the whole stream as asked (it includes waits behind other requests' prefills,
which the mocker runs whole in one step, stalling every stream of its worker), and also over the
drain alone: the gaps that overlap [SIGTERM, exit], where the move (or recompute) happens.

The move's own part of a gap is read from the processor's log: from its line saying the worker
gave the request up mid-stream (handed it over, or failed it at a recompute drain) to the
stream's next chunk: the re-route, the KV pull (or the prefill again) and the destination's
next step. Before that line, the stream waited for the old worker's step boundary and for the
KV of the requests handed over before it to be held.

The KV transfer time is the destinations' own reading of each pull (the histogram
kvmesh_kv_transfer_duration_seconds, moves included; no prefill worker pulls here): its p50
interpolated, its max only as the upper bound of the highest bucket with a pull in it. The chunk
gaps cannot give it: every one also holds a step or more of the destination's schedule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from bench.common.mesh_metrics import quantile
from bench.common.report import median, percentile
from bench.moves.load import Sent
from bench.moves.roll import Roll, Rolled

# After the last old worker's exit, the roll window runs on this long: the requests moved
# last resume (recompute: their prefill runs again) within it.
ROLL_TAIL_S = 3.0


@dataclass
class Counters:
    """The processor's counters over the roll (differences)."""

    handoffs: float = math.nan
    migrations: float = math.nan
    recomputed: float = math.nan


@dataclass
class RunRecord:
    mode: str
    repeat: int
    steady: tuple[float, float]
    roll: Roll
    counters: Counters
    sent: list[Sent]

    @property
    def roll_window(self) -> tuple[float, float]:
        last_exit = max((r.exited_at for r in self.roll.rolled), default=self.roll.ended_at)
        return self.roll.started_at, max(self.roll.ended_at, last_exit + ROLL_TAIL_S)


def goodput(sent: Sequence[Sent], window: tuple[float, float]) -> float:
    start, end = window
    return sum(s.tokens_between(start, end) for s in sent) / (end - start)


@dataclass
class Moved:
    """A stream on a rolled worker at its SIGTERM."""

    sent: Sent
    rolled: Rolled

    @property
    def gap_s(self) -> float:
        return self.sent.longest_gap_s()

    @property
    def drain_gap_s(self) -> float:
        return self.sent.longest_gap_s(self.rolled.terminated_at, self.rolled.exited_at)

    @property
    def resumed_s(self) -> float:
        """From the processor's give-up line to the next chunk (NaN: not given up mid-stream)."""
        at = self.rolled.gave_up_at.get(self.sent.request_id)
        return math.nan if at is None else self.sent.resumed_after_s(at)

    def detail(self) -> dict[str, object]:
        """For the JSON: what one moved stream saw, times in ms from the SIGTERM."""
        t0, out = self.rolled.terminated_at, self.sent.out
        gaps = [(round((a - t0) * 1000), round((b - a) * 1000)) for a, b in zip(out.arrivals, out.arrivals[1:])
                if b - a > 0.05]
        at = self.rolled.gave_up_at.get(self.sent.request_id)
        return {"request_id": self.sent.request_id, "prompt_tokens": self.sent.prompt_tokens,
                "worker": self.rolled.worker_id, "exit_ms": round(self.rolled.exit_s * 1000),
                "given_up_ms": None if at is None else round((at - t0) * 1000),
                "resumed_ms": None if math.isnan(self.resumed_s) else round(self.resumed_s * 1000),
                "gaps_over_50ms_at_ms": gaps, "exact": self.sent.exact}


def moved_streams(record: RunRecord) -> list[Moved]:
    """Each stream on a rolled worker at its SIGTERM."""
    return [Moved(s, r) for r in record.roll.rolled for s in record.sent
            if s.running_at(r.terminated_at) and (s.out.worker == r.worker_id or s.request_id in r.served)]


def _stats(values: Sequence[float], prefix: str, scale: float = 1.0) -> dict[str, float]:
    vals = sorted(v * scale for v in values if not math.isnan(v))
    if not vals:
        return {f"{prefix}_p50": math.nan, f"{prefix}_p99": math.nan, f"{prefix}_max": math.nan}
    return {f"{prefix}_p50": median(vals), f"{prefix}_p99": percentile(vals, 99), f"{prefix}_max": vals[-1]}


def transfer_figures(buckets: dict[float, float]) -> dict[str, float]:
    """p50 of the pulls (interpolated in its bucket) and the longest one's bucket bound, in ms:
    the histogram keeps no single durations, so `kv_pull_max_ms` is an upper bound."""
    pulls = max(buckets.values(), default=0.0)
    if pulls <= 0:
        return {"kv_pulls": 0.0, "kv_pull_p50_ms": math.nan, "kv_pull_max_ms": math.nan}
    finite = sorted(le for le in buckets if not math.isinf(le))
    top = next((le for le in finite if buckets[le] >= pulls), math.inf)
    return {"kv_pulls": pulls, "kv_pull_p50_ms": quantile(buckets, 0.5) * 1000, "kv_pull_max_ms": top * 1000}


def figures(record: RunRecord) -> dict[str, float]:
    steady = goodput(record.sent, record.steady)
    window = record.roll_window
    during = goodput(record.sent, window)
    moved = moved_streams(record)
    rolled = record.roll.rolled
    steady_streams = [s for s in record.sent if record.steady[0] <= s.out.started and s.out.ended < record.steady[1]]
    handed = [r.handed_over for r in rolled if r.handed_over is not None]
    out = {
        "steady_tok_s": steady,
        "steady_requests": float(sum(s.exact for s in record.sent if record.steady[0] <= s.out.ended < record.steady[1])),
        "roll_tok_s": during,
        "goodput_ratio": during / steady if steady else math.nan,
        "roll_s": window[1] - window[0],
        "recomputed_tokens": record.counters.recomputed,
        "handoffs": record.counters.handoffs,
        "migrations": record.counters.migrations,
        "handed_over": float(sum(handed)) if handed else math.nan,
        "moved_in_pulled": record.roll.pulls.moved_in.get("pulled", math.nan),
        "moved_in_recomputed": record.roll.pulls.moved_in.get("recomputed", math.nan),
        "moved_streams": float(len(moved)),
        "given_up_mid_stream": float(sum(not math.isnan(m.resumed_s) for m in moved)),
        **_stats([m.gap_s for m in moved], "gap_ms", 1000),
        **_stats([m.drain_gap_s for m in moved], "drain_gap_ms", 1000),
        **_stats([m.resumed_s for m in moved], "resumed_ms", 1000),
        **_stats([s.longest_gap_s() for s in steady_streams], "steady_gap_ms", 1000),
        **transfer_figures(record.roll.pulls.buckets),
        "kv_pulled_mib": record.roll.pulls.bytes / 2**20,
        **_stats([r.exit_s for r in rolled], "exit_s"),
        "handover_s_max": max((r.handover_s for r in rolled if r.handover_s is not None), default=math.nan),
        "killed": float(sum(r.exit_code not in (0, None) for r in rolled)),
        "requests": float(len(record.sent)),
        "errors": float(sum(not s.out.ok for s in record.sent)),
        "inexact": float(sum(not s.exact for s in record.sent)),
    }
    return out
