"""Round-robin: the candidates in instance-id order, one after the other, whatever they cache.

Ordering by id, not by arrival, makes the rotation the same on every router replica and run.
The position advances once per pick, over whichever candidates that pick was offered.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.routing.cost_function import Terms
from services.routing.pickers.base import PickContext
from services.routing.worker_pool import WorkerState


class RoundRobinPicker:
    def __init__(self) -> None:
        self._next = 0

    def pick(self, candidates: Sequence[WorkerState], context: PickContext) -> WorkerState:
        ordered = sorted(candidates, key=lambda w: w.info.instance_id)
        choice = ordered[self._next % len(ordered)]
        self._next += 1
        return choice

    def terms(self, candidates: Sequence[WorkerState], context: PickContext) -> list[Terms]:
        return []
