"""What carries a plan out: the `Connector` interface every connector implements."""

from __future__ import annotations

from typing import Protocol

from services.planner.pools import PoolSizes


class ConnectorError(Exception):
    """The connector could not read or change the pools; the planner logs it and tries again
    at its next adjustment."""


class Connector(Protocol):
    # Shown in logs.
    name: str
    # False for the dry run: its plans are exported, never counted as switches or scale events.
    acts: bool

    async def current(self) -> PoolSizes | None:
        """The pool sizes the connector controls now (None: it controls nothing, the planner
        goes by the workers registered in etcd)."""
        ...

    async def apply(self, current: PoolSizes, desired: PoolSizes) -> int:
        """Moves the pools from `current` to `desired`; returns how many workers it moved by
        switching their role (the rest of the change it made by starting or stopping workers).
        Raises ConnectorError when it cannot."""
        ...

    async def close(self) -> None:
        ...
