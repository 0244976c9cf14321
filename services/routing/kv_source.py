"""Per worker, where the router learns its cache: its KV events (the index) or a prediction from
the prompts routed to it (predicted_cache.py). A state machine, fed by the worker pool and
evaluated every `EVALUATE_EVERY_S`; the clock is injected so tests drive it.

A worker is predicted while:
- `worker_off`: its etcd record says it publishes no events (`--kv-events off` on the worker), or
  `router_off`: the router follows no events at all (`--kv-events off` on the router);
- `stream_lost`: its event stream delivered nothing, not even the log's heartbeat (one a second
  when idle), for `STREAM_GRACE_S`: broken and not back, or open and silent;
- `inaccurate`: its recent index accuracy (index_accuracy.py, `recent(worker)`) fell under the
  floor. The pool then rebuilds its blocks from a snapshot and keeps applying its events to the
  index while predicting.

It goes back to events when the cause is gone: the stream delivers again (`stream_back`), or,
for `inaccurate`, its index agrees with its engine again (`agreeing`). While it is predicted the
pool keeps applying its events, and each request routed to it also records what the index alone
said it caches; the engine's cached_tokens then judge that (index_accuracy.py's ratio, one
agreement sample). The mean of the last `AGREEMENT_SAMPLES` at or over the floor sends it back.
Whatever the samples, events are tried again `RETRY_EVENTS_S` after the switch (`retry`): an index
that is still wrong then switches it back once enough fresh samples say so, so a worker costs at
most about one resync per that interval. Each switch starts the worker's accuracy afresh (the
pool forgets its samples), so samples of one source never judge the other.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

log = logging.getLogger(__name__)


class KvSource(StrEnum):
    """Where the router learns a worker's cache (the `kvmesh_router_kv_source` gauge's 0 and 1)."""

    EVENTS = "events"
    PREDICTED = "predicted"


class SwitchReason(StrEnum):
    """Why a worker's source switched (a label of `kvmesh_router_kv_source_switches_total`)."""

    ROUTER_OFF = "router_off"
    WORKER_OFF = "worker_off"
    STREAM_LOST = "stream_lost"
    INACCURATE = "inaccurate"
    STREAM_BACK = "stream_back"
    EVENTS_ON = "events_on"
    AGREEING = "agreeing"
    RETRY = "retry"


EVENTS = KvSource.EVENTS
PREDICTED = KvSource.PREDICTED
# The default of `--index-accuracy-floor` (config.py).
DEFAULT_ACCURACY_FLOOR = 0.5
STREAM_GRACE_S = 3.0
EVALUATE_EVERY_S = 0.5
AGREEMENT_SAMPLES = 8
RETRY_EVENTS_S = 60.0

# (worker, new source, reason)
SwitchListener = Callable[[str, KvSource, SwitchReason], None]


@dataclass(slots=True)
class _Worker:
    publishes: bool
    last_heard: float
    source: KvSource = EVENTS
    reason: SwitchReason | None = None  # why it is predicted (None while on its events)
    since: float = 0.0
    agreement: deque[float] = field(default_factory=lambda: deque(maxlen=AGREEMENT_SAMPLES))


class KvSourceTracker:
    def __init__(self, on_switch: SwitchListener, accuracy_floor: float, router_off: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._on_switch = on_switch
        self.accuracy_floor = accuracy_floor
        self.router_off = router_off
        self._clock = clock
        self._workers: dict[str, _Worker] = {}

    def add(self, worker: str, publishes: bool) -> None:
        """A worker joined (or its record changed); its stream has until the grace to deliver."""
        state = self._workers.get(worker)
        if state is None:
            self._workers[worker] = _Worker(publishes, self._clock())
            self.evaluate(worker, None)
        elif state.publishes != publishes:
            state.publishes = publishes
            state.last_heard = self._clock()
            self.evaluate(worker, None)

    def forget(self, worker: str) -> None:
        self._workers.pop(worker, None)

    def workers(self) -> list[str]:
        return list(self._workers)

    def source(self, worker: str) -> KvSource:
        state = self._workers.get(worker)
        if state is None:
            return PREDICTED if self.router_off else EVENTS
        return state.source

    def predicted(self, worker: str) -> bool:
        return self.source(worker) == PREDICTED

    def heard(self, worker: str) -> None:
        """The worker's event stream delivered a batch (events or a heartbeat)."""
        state = self._workers.get(worker)
        if state is not None:
            state.last_heard = self._clock()

    def wants_agreement(self, worker: str) -> bool:
        state = self._workers.get(worker)
        return state is not None and state.reason is SwitchReason.INACCURATE

    def agreement(self, worker: str, ratio: float) -> None:
        """One routed request's ratio of what the index said to what the engine found, while the
        worker is predicted as inaccurate."""
        state = self._workers.get(worker)
        if state is not None and state.reason is SwitchReason.INACCURATE:
            state.agreement.append(ratio)

    def index_still_warm(self, worker: str, ttl_s: float) -> bool:
        """Whether the index's blocks of a worker whose stream went quiet are still worth counting
        beside its prediction: they were right when it went quiet, and a prediction made since then
        would still hold them for `ttl_s` (so the prediction starts warm without recording every
        worker's prompts while its events are healthy)."""
        state = self._workers.get(worker)
        return (state is not None and state.reason is SwitchReason.STREAM_LOST
                and self._clock() - state.since < ttl_s)

    def evaluate(self, worker: str, accuracy: float | None) -> SwitchReason | None:
        """Switches the worker where its inputs say; returns the reason of a switch (None if none)."""
        state = self._workers.get(worker)
        if state is None:
            return None
        now = self._clock()
        if self.router_off:
            return self._switch(state, worker, PREDICTED, SwitchReason.ROUTER_OFF, now)
        if not state.publishes:
            return self._switch(state, worker, PREDICTED, SwitchReason.WORKER_OFF, now)
        if now - state.last_heard > STREAM_GRACE_S:
            return self._switch(state, worker, PREDICTED, SwitchReason.STREAM_LOST, now)
        if state.reason is SwitchReason.INACCURATE:
            samples = state.agreement
            if len(samples) >= AGREEMENT_SAMPLES and sum(samples) / len(samples) >= self.accuracy_floor:
                return self._switch(state, worker, EVENTS, SwitchReason.AGREEING, now)
            if now - state.since >= RETRY_EVENTS_S:
                return self._switch(state, worker, EVENTS, SwitchReason.RETRY, now)
            return None
        if accuracy is not None and accuracy < self.accuracy_floor:
            return self._switch(state, worker, PREDICTED, SwitchReason.INACCURATE, now)
        if state.source == PREDICTED:
            back = SwitchReason.STREAM_BACK if state.reason is SwitchReason.STREAM_LOST else SwitchReason.EVENTS_ON
            return self._switch(state, worker, EVENTS, back, now)
        return None

    def _switch(self, state: _Worker, worker: str, source: KvSource, reason: SwitchReason, now: float
                ) -> SwitchReason | None:
        if state.source == source and (source == EVENTS or state.reason == reason):
            return None
        state.source, state.reason, state.since = source, reason if source == PREDICTED else None, now
        state.agreement.clear()
        self._on_switch(worker, source, reason)
        return reason
