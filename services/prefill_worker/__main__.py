"""python -m services.prefill_worker: runs prefills and hands the KV cache to decode workers over NIXL.

It registers, streams its KV events and load like any worker (its prefix cache makes the router's
KV-aware choice over the prefill pool worthwhile), and serves the `Prefiller` service.
"""

from __future__ import annotations

from functools import partial

from gen.kvmesh.v1 import worker_pb2_grpc
from services.engines.base import Engine
from services.mesh.discovery import PREFILL_WORKER
from services.mesh.grpc_server import ServiceBinding
from services.mesh.tracing import TRACING_OFF, Tracing
from services.contract.worker_roles import RoleName
from services.worker.prefill_servicer import PREFILLER_SERVICE, PrefillServicer
from services.worker.kv_event_log import KvEventLog
from services.worker.runtime import Role, ServicesFactory, WorkerContext, WorkerServices, main
from services.worker.pacing import DEFAULT_INTERVAL_S
from services.worker.remote_encode import RemoteEncoder, remote_encoder
from services.worker.servicer import WorkerServicer


def services(engine: Engine, worker_id: str, events: KvEventLog, tracing: Tracing = TRACING_OFF,
             stream_interval_s: float = DEFAULT_INTERVAL_S, encoder: RemoteEncoder | None = None) -> WorkerServices:
    prefiller = ServiceBinding(worker_pb2_grpc.add_PrefillerServicer_to_server,
                               PrefillServicer(engine, tracing, encoder=encoder), PREFILLER_SERVICE)
    return WorkerServices(WorkerServicer(engine, worker_id, events, tracing, stream_interval_s), (prefiller,))


async def prepare(ctx: WorkerContext) -> ServicesFactory:
    return partial(services, tracing=ctx.tracing, stream_interval_s=ctx.args.stream_interval_ms / 1000,
                   encoder=await remote_encoder(ctx.engine.kv_transfer, ctx.args, ctx.runner, ctx.registry))


# A prefill worker without KV transfer could hand nothing over: NIXL is its default.
ROLE = Role(PREFILL_WORKER, RoleName.PREFILL, prepare, default_kv_transfer="nixl")

if __name__ == "__main__":
    main(ROLE)
