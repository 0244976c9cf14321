"""python -m services.prefill_worker: runs prefills and hands the KV cache to decode workers over NIXL.

It registers, streams its KV events and load like any worker (its prefix cache makes the router's
KV-aware choice over the prefill pool worthwhile), and serves Prefill and ReleaseKv.
"""

from __future__ import annotations

import sys

from services.common.discovery import PREFILL_WORKER
from services.common.kv_event_log import KvEventLog
from services.common.worker_runtime import Role, WorkerContext, main
from services.common.worker_servicer import WorkerServicer
from services.engines.base import Engine


def servicer(engine: Engine, worker_id: str, events: KvEventLog, ctx: WorkerContext) -> WorkerServicer:
    return WorkerServicer(engine, worker_id, events)


if __name__ == "__main__":
    # A prefill worker without KV transfer could hand nothing over: NIXL is its default.
    if not any(a == "--kv-transfer" or a.startswith("--kv-transfer=") for a in sys.argv):
        sys.argv += ["--kv-transfer", "nixl"]
    main(Role(PREFILL_WORKER, "prefill", servicer))
