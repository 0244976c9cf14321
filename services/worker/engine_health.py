"""A worker whose engine died or hangs leaves the mesh instead of failing every request sent to it.

Every `CHECK_EVERY_S` the engine's `check_health` runs with a deadline. One that raises, or
`MAX_SLOW_CHECKS` in a row that overrun their deadline, means the engine cannot serve: the
worker's gRPC health turns NOT_SERVING and the check ends with the reason. The worker runtime
watches this task, so the service runner then stops the whole worker (deregistering first) and
the process exits 1 for whoever supervises it to restart.
"""

from __future__ import annotations

import asyncio
import logging

from grpc_health.v1 import health

from services.engines.base import Engine

log = logging.getLogger(__name__)

CHECK_EVERY_S = 1.0
CHECK_DEADLINE_S = 5.0
MAX_SLOW_CHECKS = 3


class EngineFailed(Exception):
    """The engine cannot serve any more."""


async def watch_engine(engine: Engine, health_servicer: health.HealthServicer, worker_id: str,
                       every_s: float = CHECK_EVERY_S, deadline_s: float = CHECK_DEADLINE_S) -> None:
    """Runs until the engine fails, then marks the worker NOT_SERVING and raises EngineFailed."""
    slow = 0
    while True:
        await asyncio.sleep(every_s)
        try:
            await asyncio.wait_for(engine.check_health(), deadline_s)
            slow = 0
            continue
        except TimeoutError:
            slow += 1
            log.warning("worker %s: engine health check overran %.0fs (%d in a row)", worker_id, deadline_s, slow)
            if slow < MAX_SLOW_CHECKS:
                continue
            reason = f"the engine has not answered a health check for {slow} checks"
        except Exception as exc:  # noqa: BLE001 - any failure of the check means the engine is gone
            reason = f"the engine failed: {exc}"
        await health_servicer.enter_graceful_shutdown()  # every service NOT_SERVING, for good
        log.error("worker %s: %s; leaving the mesh", worker_id, reason)
        raise EngineFailed(reason)
