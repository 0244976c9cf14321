"""Round-robin: the candidates in instance-id order, one after the other, whatever they cache.

The rotation is services/mesh/turns.py's; its position advances once per pick, over whichever
candidates that pick was offered.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.mesh.turns import in_turn
from services.routing.cost_function import Terms
from services.routing.pickers.base import PickContext
from services.routing.worker_pool import WorkerState


class RoundRobinPicker:
    def __init__(self) -> None:
        self._next = 0

    def pick(self, candidates: Sequence[WorkerState], context: PickContext) -> WorkerState:
        choice = in_turn(candidates, self._next, lambda w: w.info.instance_id)[0]
        self._next += 1
        return choice

    def terms(self, candidates: Sequence[WorkerState], context: PickContext) -> list[Terms]:
        return []
