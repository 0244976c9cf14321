"""The queue wait a new request is forecast, from the queue as it stands and the pace the pool
and each line of the queue kept lately (prediction.py holds the measures).

A request runs once the requests ahead of it have ended: those waiting before it (the fair
queue's estimate), those in the workers' own queues, and one more for the slot it takes itself.
It leaves this queue earlier, as soon as a worker's own queue has room for it. Two corrections
on top, both per line (a tenant's requests in one band): the line may move slower than its share
says, when other tenants keep arriving ahead of it or higher bands take their turns, so it is
given at most the pace that line kept; and its forecasts are lengthened by how late the line's
forecasts came true lately (their 98th percentile error). Per line, because lines err apart: a
low band's requests keep being overtaken, a high band's never are.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from services.mesh.recent_quantile import RecentQuantile
from services.routing.admission.prediction import HoldTime, LineRate, ServiceRate, queue_wait_s

# Lines (model, band, tenant) whose pace is remembered before the idle ones are forgotten.
MAX_LINES = 1024
# The quantile of the forecasts' error that every forecast adds.
LATE_QUANTILE = 0.98


@dataclass(frozen=True, slots=True)
class Forecast:
    """A new request's predicted wait: until it runs on a worker, and until it leaves this queue."""

    start_s: float
    leave_s: float


NO_WAIT = Forecast(0.0, 0.0)


@dataclass(frozen=True, slots=True)
class Standing:
    """The queue and the pool as a new request finds them."""

    ahead: float  # waiting here before it (fair queue's estimate)
    own: int  # waiting here in its own line
    on_workers: float  # in the workers' own queues
    worker_queues: int  # room in the workers' own queues, all of it
    slots: int


@dataclass(frozen=True, slots=True)
class _Line:
    pace: LineRate
    # How much later than forecast its requests left the queue.
    late: RecentQuantile


class Forecaster:
    def __init__(self, fallback_hold_s: float) -> None:
        # Until a request has ended, a request is taken to hold its slot this long.
        self._fallback_hold_s = fallback_hold_s
        self.hold = HoldTime()
        self.rate = ServiceRate()
        self._lines: dict[tuple[str, int, str], _Line] = {}

    def forecast(self, line: tuple[str, int, str], standing: Standing) -> Forecast:
        now = time.monotonic()
        rate = self.rate.per_s(now)
        per_end = 1 / rate if rate else queue_wait_s(1, standing.slots, self.hold.or_else(self._fallback_hold_s))
        ahead = standing.ahead + standing.on_workers + 1
        leave = max(0.0, ahead - standing.worker_queues) * per_end
        known = self._lines.get(line)
        if known is None:
            return Forecast(ahead * per_end, leave)
        line_rate = known.pace.per_s(now) if standing.own else None
        slower = max(0.0, (standing.own + 1) / line_rate - leave) if line_rate else 0.0
        late = slower + max(0.0, known.late.value)
        return Forecast(ahead * per_end + late, leave + late)

    def ended(self, held_s: float, pool_full: bool) -> None:
        """A placed request ended after `held_s` on its worker."""
        self.hold.observe(held_s)
        if pool_full:
            self.rate.ended_while_full(time.monotonic())

    def departed(self, line: tuple[str, int, str], still_waiting: int) -> None:
        """A request of `line` left the queue for a worker."""
        self._line(line).pace.departed(time.monotonic(), still_waiting)

    def came_true(self, line: tuple[str, int, str], forecast_s: float, waited_s: float) -> None:
        """A request of `line` forecast to leave after `forecast_s` left after `waited_s`."""
        self._line(line).late.observe(waited_s - forecast_s)

    def _line(self, line: tuple[str, int, str]) -> _Line:
        known = self._lines.get(line)
        if known is None:
            if len(self._lines) >= MAX_LINES:  # forget the lines that moved nothing lately
                now = time.monotonic()
                self._lines = {k: v for k, v in self._lines.items() if v.pace.per_s(now) is not None}
            known = self._lines[line] = _Line(LineRate(), RecentQuantile(LATE_QUANTILE))
        return known

    def hold_s(self) -> float:
        return self.hold.or_else(self._fallback_hold_s)
