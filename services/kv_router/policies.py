"""Worker selection policies that need no KV knowledge: round-robin, random, least-loaded."""

from __future__ import annotations

import random
from collections.abc import Sequence

from services.kv_router.worker_pool import WorkerState


class RoundRobin:
    def __init__(self) -> None:
        self._next = 0

    def pick(self, candidates: Sequence[WorkerState]) -> WorkerState:
        ordered = sorted(candidates, key=lambda w: w.info.instance_id)
        choice = ordered[self._next % len(ordered)]
        self._next += 1
        return choice


class RandomChoice:
    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(self, candidates: Sequence[WorkerState]) -> WorkerState:
        return self._rng.choice(list(candidates))


def load_score(w: WorkerState) -> float:
    """Fraction of a worker's capacity in use, counting requests we sent since its last report."""
    m = w.load
    slots = m.request_total_slots or 1
    busy = m.request_active_slots + m.num_requests_waiting + w.dispatched_since_load
    return busy / slots + m.gpu_cache_usage_perc


class LeastLoaded:
    """The fallback when the KV index has nothing to say: the least busy worker, ties at random."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(self, candidates: Sequence[WorkerState]) -> WorkerState:
        scores = [(load_score(w), w) for w in candidates]
        best = min(s for s, _ in scores)
        return self._rng.choice([w for s, w in scores if s == best])
