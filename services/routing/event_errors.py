"""What the router does with a KV event its index cannot apply: count it by kind, say so at
WARNING (at most once per worker per `WARN_INTERVAL_S`, naming the kinds and counts since the
last line), and decide when the worker's blocks must be rebuilt from a snapshot.

Resync rule: a resync is called for after an `UNKNOWN_PARENT` (an event before it was lost, so
everything below that parent is missing), after more than `RESYNC_AFTER_ERRORS` errors within
`RESYNC_WINDOW_S`, and by the follower for every other `ResyncReason` (a gap in the ids, a restart
without a snapshot, an index found inaccurate). Every one of them goes through the same limit:
after a resync the next waits `interval`, which is `RESYNC_MIN_INTERVAL_S` and doubles with each
resync that comes within twice the interval of the one before, up to `RESYNC_MAX_INTERVAL_S`; a
worker that needs none for twice its interval starts again at the minimum. So an engine that
keeps sending events the index refuses, or whose ids keep skipping, costs one snapshot per
interval, not one per batch; meanwhile its errors are still counted, the follower goes on
applying what it can, and the resync called for waits (`due` hands it out once the interval has
passed, under the first reason called for). A snapshot that arrives anyway satisfies it.
`UNKNOWN_BLOCK` is counted and reported but never resyncs: the index drops the children of a node
no worker holds any more (kv_index.py), so an engine that evicts a parent before its children
later names children the index already let go of, in a view that is nonetheless right.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from services.routing.kv_index import EventErrorKind

log = logging.getLogger(__name__)


class ResyncReason(StrEnum):
    """Why a worker's blocks are rebuilt from a snapshot (a label of `kvmesh_router_kv_resyncs_total`)."""

    UNKNOWN_PARENT = EventErrorKind.UNKNOWN_PARENT.value  # a store under a block the index never saw
    ERRORS = "errors"  # more than RESYNC_AFTER_ERRORS errors within RESYNC_WINDOW_S
    GAP = "gap"  # event ids jumped: events lost on the way
    # The worker's log is another incarnation (it restarted): counted when its snapshot arrives,
    # called for when it sent none.
    RESTART = "restart"
    INACCURATE = "inaccurate"  # its index accuracy fell under the floor (kv_source.py)


WARN_INTERVAL_S = 30.0
RESYNC_AFTER_ERRORS = 3
RESYNC_WINDOW_S = 10.0
RESYNC_MIN_INTERVAL_S = 10.0
RESYNC_MAX_INTERVAL_S = 160.0
# Errors of one worker remembered for the window (a bound, whatever the rate).
MAX_RECENT = 64


@dataclass(slots=True)
class _WorkerErrors:
    since_warning: Counter[EventErrorKind] = field(default_factory=Counter)
    last_warning: float = float("-inf")
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_RECENT))
    last_resync: float = float("-inf")
    # The wait after `last_resync` before the next (the backoff).
    interval: float = RESYNC_MIN_INTERVAL_S
    # A resync called for that waits for the interval (the first reason since the last resync).
    called_for: ResyncReason | None = None


class EventErrorLedger:
    def __init__(self, count: Callable[[str, EventErrorKind, int], None] = lambda *_: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`count(worker, kind, n)`: the metric (kvmesh_router_kv_event_errors_total)."""
        self.count = count
        self._clock = clock
        self._workers: dict[str, _WorkerErrors] = {}

    def record(self, worker: str, kind: EventErrorKind, n: int = 1) -> ResyncReason | None:
        """Counts `n` errors of a kind; returns the reason to resync the worker now, if one is due
        (`due`: the errors call for one and its interval has passed)."""
        if n <= 0:
            return None
        now = self._clock()
        errors = self._workers.setdefault(worker, _WorkerErrors())
        self.count(worker, kind, n)
        errors.since_warning[kind] += n
        if kind is not EventErrorKind.UNKNOWN_BLOCK:
            errors.recent.extend([now] * min(n, MAX_RECENT))
        if now - errors.last_warning >= WARN_INTERVAL_S:
            kinds = ", ".join(f"{k.value} x{c}" for k, c in sorted(errors.since_warning.items(), key=lambda i: i[0].value))
            log.warning("worker %s: KV events the index could not apply since the last report: %s", worker, kinds)
            errors.since_warning.clear()
            errors.last_warning = now
        while errors.recent and errors.recent[0] < now - RESYNC_WINDOW_S:
            errors.recent.popleft()
        if kind is EventErrorKind.UNKNOWN_PARENT:
            self.call_for(worker, ResyncReason.UNKNOWN_PARENT)
        elif len(errors.recent) > RESYNC_AFTER_ERRORS:
            self.call_for(worker, ResyncReason.ERRORS)
        return self.due(worker)

    def call_for(self, worker: str, reason: ResyncReason) -> None:
        """The worker's view is wrong: a resync is called for, which `due` hands out once the
        interval since the last has passed (at once, where it has)."""
        errors = self._workers.setdefault(worker, _WorkerErrors())
        if errors.called_for is None:
            errors.called_for = reason

    def due(self, worker: str) -> ResyncReason | None:
        """The resync called for, once its interval has passed (taken: it counts as started)."""
        errors = self._workers.get(worker)
        if errors is None or errors.called_for is None:
            return None
        now = self._clock()
        since = now - errors.last_resync
        if since < errors.interval:
            return None
        reason, errors.called_for = errors.called_for, None
        # Consecutive: within twice the interval of the one before (it backs off); else from the minimum.
        errors.interval = (min(RESYNC_MAX_INTERVAL_S, 2 * errors.interval) if since < 2 * errors.interval
                           else RESYNC_MIN_INTERVAL_S)
        errors.last_resync = now
        errors.recent.clear()
        return reason

    def rebuilt(self, worker: str) -> None:
        """A snapshot of the worker arrived: a resync still called for is done, the error window
        starts over (the interval does not: it counts the resyncs this ledger handed out)."""
        errors = self._workers.get(worker)
        if errors is not None:
            errors.called_for = None
            errors.recent.clear()

    def forget(self, worker: str) -> None:
        self._workers.pop(worker, None)
