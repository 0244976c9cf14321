"""Worker selection policies that need no KV knowledge: round-robin and random."""

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
