"""Random: a uniform choice among the candidates, whatever they cache.

The router's one seeded generator draws it, so a seeded router repeats its choices run to run.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from services.routing.cost_function import Terms
from services.routing.pickers.base import PickContext
from services.routing.worker_pool import WorkerState


class RandomPicker:
    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(self, candidates: Sequence[WorkerState], context: PickContext) -> WorkerState:
        return self._rng.choice(list(candidates))

    def terms(self, candidates: Sequence[WorkerState], context: PickContext) -> list[Terms]:
        return []
