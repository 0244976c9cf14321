"""Taking turns over instances: the one rotation the gateway (processors), the router client
(routers) and the round-robin router mode (workers) use.

Ordering by instance id, not by arrival, makes the rotation the same on every replica and run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


def in_turn(items: Iterable[T], turn: int, instance_id: Callable[[T], str]) -> list[T]:
    """`items` in instance-id order, rotated to start at the `turn`-th (modulo their number)."""
    ordered = sorted(items, key=instance_id)
    if not ordered:
        return []
    start = turn % len(ordered)
    return ordered[start:] + ordered[:start]
