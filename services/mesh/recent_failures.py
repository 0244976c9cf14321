"""Instances a client saw fail, passed over in its choices before their lease runs out.

A SIGKILLed instance stays registered until its etcd lease expires (up to the lease TTL);
without this list every request sent to it in the meantime would fail once first. An entry
expires after `hold_s` (longer than a lease TTL): by then a dead instance has left the mesh, and
one that only lost one stream is chosen again. A restarted instance registers under a new
instance id, so it is never held back by its predecessor's entry. The processor keeps one for
decode workers, the gateway one for processors.

Passed over, not refused: when every other instance is gone (the one healthy peer lost its
lease), a choice takes a listed one rather than turn a request away that it may well serve.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# Longer than the lease TTL (10 s), so the entry outlives a dead instance's registration.
HOLD_S = 15.0
MAX_ENTRIES = 1024


class RecentFailures:
    def __init__(self, hold_s: float = HOLD_S, max_entries: int = MAX_ENTRIES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`clock`: seconds from any fixed point; a test passes its own to expire entries at once."""
        self._hold_s = hold_s
        self._max_entries = max_entries
        self._clock = clock
        self._until: dict[str, float] = {}

    def add(self, instance_id: str) -> None:
        now = self._clock()
        self._prune(now)
        if len(self._until) >= self._max_entries:
            self._until.pop(next(iter(self._until)))
        self._until[instance_id] = now + self._hold_s

    def discard(self, instance_id: str) -> None:
        """The instance answered again: no longer kept out."""
        self._until.pop(instance_id, None)

    def current(self) -> list[str]:
        """The instances to pass over right now while another can be chosen (a choice falls back
        to them when none is left: the list must never refuse what a live instance can serve)."""
        if not self._until:
            return []
        self._prune(self._clock())
        return list(self._until)

    def _prune(self, now: float) -> None:
        for instance_id in [i for i, until in self._until.items() if until <= now]:
            del self._until[instance_id]
