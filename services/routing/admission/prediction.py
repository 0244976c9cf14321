"""Predicted time to first token for a request that would queue now:

    ttft = queue wait + prefill on the worker that would take it

The queue wait is the requests ahead of it (the fair queue's estimate, and those in the workers'
own queues) over the pool's service rate: the ends per second measured while the pool was full
(`ServiceRate`), else its slots over how long a request holds one (dispatch to end on this
router, a moving average). Until one has ended the hold is assumed to be the objective itself,
so a cold router admits about one wave of the pool's slots, not an unbounded queue.
The prefill is the uncached part of the prompt at what the worker says a token costs
(`LoadMetrics.prefill_cost`, the profile the worker was calibrated with); a worker that says
nothing is charged nothing.
"""

from __future__ import annotations

from collections import deque

from gen.kvmesh.v1 import worker_pb2

# Weight of a new hold time in the moving average: about the last 20 requests count.
HOLD_ALPHA = 0.05
# The pool's service rate is read from its last ends while it was full: at most this many, in
# at most this window, and at least this many for a reading.
RATE_ENDS = 64
RATE_WINDOW_S = 5.0
MIN_RATE_ENDS = 8


class HoldTime:
    def __init__(self) -> None:
        self.mean_s: float | None = None

    def observe(self, seconds: float) -> None:
        self.mean_s = seconds if self.mean_s is None else self.mean_s + HOLD_ALPHA * (seconds - self.mean_s)

    def or_else(self, fallback_s: float) -> float:
        return self.mean_s if self.mean_s is not None else fallback_s


class ServiceRate:
    """Requests ended per second while the pool was full (so the ends were its capacity, not its
    arrivals): measured directly, it includes everything a model of it would miss (slots freed
    late, the lag of load reports, the mix of lengths). None until enough were seen."""

    def __init__(self) -> None:
        self._ends: deque[float] = deque(maxlen=RATE_ENDS)

    def ended_while_full(self, now: float) -> None:
        self._ends.append(now)

    def per_s(self, now: float) -> float | None:
        ends = self._ends
        while ends and ends[0] < now - RATE_WINDOW_S:
            ends.popleft()
        if len(ends) < MIN_RATE_ENDS or ends[-1] <= ends[0]:
            return None
        return (len(ends) - 1) / (ends[-1] - ends[0])


class LineRate:
    """How fast one line of the queue (a tenant's requests in a band) moves while it has a
    backlog: the mean gap between its departures, counting only gaps it spent waiting (a line
    that emptied and filled again says nothing about its pace in between)."""

    def __init__(self) -> None:
        self._gaps: deque[tuple[float, float]] = deque(maxlen=RATE_ENDS)  # (at, gap)
        self._last = 0.0
        self._backlogged = False

    def departed(self, now: float, still_waiting: int) -> None:
        if self._backlogged:
            self._gaps.append((now, now - self._last))
        self._last = now
        self._backlogged = still_waiting > 0

    def per_s(self, now: float) -> float | None:
        gaps = self._gaps
        while gaps and gaps[0][0] < now - RATE_WINDOW_S:
            gaps.popleft()
        total = sum(g for _, g in gaps)
        if len(gaps) < MIN_RATE_ENDS or total <= 0:
            return None
        return len(gaps) / total


def queue_wait_s(ahead: float, slots: int, hold_s: float) -> float:
    """Seconds until `ahead` requests have left the queue, at `slots` requests per `hold_s`."""
    if ahead <= 0 or slots <= 0:
        return 0.0
    return ahead * hold_s / slots


def prefill_s(load: worker_pb2.LoadMetrics, uncached_tokens: int, cached_tokens: int) -> float:
    """The worker's own price of computing `uncached_tokens` after `cached_tokens` (its
    `PrefillCost`: per token, plus attention growing with the position)."""
    if uncached_tokens <= 0 or not load.HasField("prefill_cost"):
        return 0.0
    cost = load.prefill_cost
    mean_position = cached_tokens + uncached_tokens / 2
    return uncached_tokens * (cost.us_per_token + cost.us_per_token_per_1k * mean_position / 1000) / 1e6
