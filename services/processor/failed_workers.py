"""Workers this processor saw fail, kept out of its routing before their lease runs out.

A SIGKILLed worker stays registered until its etcd lease expires (up to the lease TTL); without
this list every request routed to it in the meantime would fail once first. An entry expires
after `hold_s` (longer than a lease TTL): by then a dead worker has left the mesh, and a worker
that only lost one stream is admitted again. A restarted worker registers under a new instance
id, so it is never held back by its predecessor's entry.
"""

from __future__ import annotations

import time

# Longer than the lease TTL (10 s), so the entry outlives a dead worker's registration.
HOLD_S = 15.0
MAX_ENTRIES = 1024


class FailedWorkers:
    def __init__(self, hold_s: float = HOLD_S, max_entries: int = MAX_ENTRIES) -> None:
        self._hold_s = hold_s
        self._max_entries = max_entries
        self._until: dict[str, float] = {}

    def add(self, worker_id: str) -> None:
        now = time.monotonic()
        self._prune(now)
        if len(self._until) >= self._max_entries:
            self._until.pop(next(iter(self._until)))
        self._until[worker_id] = now + self._hold_s

    def current(self) -> list[str]:
        """The workers to keep out of routing right now."""
        if not self._until:
            return []
        self._prune(time.monotonic())
        return list(self._until)

    def _prune(self, now: float) -> None:
        for worker_id in [w for w, until in self._until.items() if until <= now]:
            del self._until[worker_id]
