"""A picker chooses one worker of a pool for a prompt; each router mode is one picker, so a mode
is a class with one method instead of a branch in the router, and the router stays the same
whichever mode it runs.

Pickers only choose: the router (router.py) finds the candidates (the pool's workers serving the
model, minus exclusions), scores the prompt against the index, and does the pending accounting after.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from services.routing.cost_function import Terms
from services.routing.worker_adapters import AdapterView
from services.routing.worker_pool import WorkerState


@dataclass(frozen=True, slots=True)
class PickContext:
    """What the router knows about the prompt when it picks; modes that ignore the cache ignore it."""

    # Per worker id, the prompt's blocks it already caches (the index's `find_matches`).
    overlaps: Mapping[Hashable, int]
    block_size: int
    num_tokens: int
    # Blocks the index holds for a worker id: the cost function's tie-breaker. A function, not a
    # table, so modes that never break ties pay nothing for it.
    indexed_blocks: Callable[[str], int]
    # Per worker id, the prompt's blocks it holds in host memory only (`find_matches_by_tier`).
    host_overlaps: Mapping[Hashable, int] = field(default_factory=dict)
    # Per worker id holding some, what each of those host blocks is worth against a device block
    # (host_credit.py). Worked out once per decision, by the router, so the pick, its explanation
    # and the prefix hit rate reported all weigh the same number.
    host_credits: Mapping[str, float] = field(default_factory=dict)
    # Per worker id, the request's LoRA adapter there (worker_adapters.py); empty for the base
    # model. Worked out once per decision, by the router, as the host credits are.
    adapters: Mapping[str, AdapterView] = field(default_factory=dict)
    # The worker the request's agent session prefers (its binding, or its parent's), and by how
    # much (session_bindings.py): None, for a request of no session or one bound nowhere.
    session_worker: str | None = None
    session_weight: float = 0.0
    # Per worker id whose encoder cache holds some of the prompt's images, their worth in cached
    # blocks (encoder_credit.py).
    encoder_blocks: Mapping[str, float] = field(default_factory=dict)


class Picker(Protocol):
    def pick(self, candidates: Sequence[WorkerState], context: PickContext) -> WorkerState:
        """One of `candidates` (never empty) for the prompt described by `context`."""
        ...

    def terms(self, candidates: Sequence[WorkerState], context: PickContext) -> list[Terms]:
        """What the mode weighed per candidate, for explaining a pick (asked for only when wanted,
        so picking never pays for it); empty for a mode that weighs nothing."""
        ...
