"""The dry-run connector: the plan is logged and exported, nothing is changed.

It plans from the pools as they would be had every plan been carried out, so its metrics show
the sizes the planner would choose over time (cool-down and hysteresis included), not one
proposal repeated against pools that never move.
"""

from __future__ import annotations

import logging

from services.planner.pools import PoolSizes

log = logging.getLogger(__name__)


class DryRun:
    name = "none"
    acts = False

    def __init__(self) -> None:
        self._planned: PoolSizes | None = None

    async def current(self) -> PoolSizes | None:
        return self._planned

    async def apply(self, current: PoolSizes, desired: PoolSizes) -> int:
        log.info("dry run: would move the pools from %s to %s (--connector none changes nothing)", current, desired)
        self._planned = desired
        return 0

    async def close(self) -> None:
        return None
