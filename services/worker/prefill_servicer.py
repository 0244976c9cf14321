"""The prefill worker's `Prefiller` service: run a prompt, hold its KV for a decode worker.

`Prefill` computes the prompt's KV and keeps it until the decode worker that pulls it over NIXL
is done, or until `ReleaseKv` says the decode side gave up (a hold also expires on its own).
Each call is a span (`prefill`, `release kv`) in the trace of the decode worker that asked.
"""

from __future__ import annotations

import json
import logging

import grpc

from gen.kvmesh.v1 import worker_pb2, worker_pb2_grpc
from services.engines.base import Engine, EngineBusy, EngineRequest
from services.mesh.grpc_server import abort_with
from services.mesh.tracing import TRACING_OFF, Tracing
from services.mesh.logs import REQUEST_ID
from services.mesh.session_kind import CallError
from services.mesh.worker_roles import RoleName
from services.worker.role_switch import Admit, always
from services.worker.servicer import refused, sampling_from_proto

log = logging.getLogger(__name__)

PREFILLER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Prefiller"].full_name
PREFILL_RPC = "kvmesh.v1.Prefiller/Prefill"
RELEASE_RPC = "kvmesh.v1.Prefiller/ReleaseKv"


class PrefillServicer(worker_pb2_grpc.PrefillerServicer):
    """`admit` gates each call by role: a prefill worker admits every one, a worker that can switch
    roles only while it serves the prefill role."""

    def __init__(self, engine: Engine, tracing: Tracing = TRACING_OFF, admit: Admit = always) -> None:
        self.engine = engine
        self.tracing = tracing
        self.admit = admit

    async def Prefill(self, request: worker_pb2.PrefillRequest,  # noqa: N802
                      context: grpc.aio.ServicerContext) -> worker_pb2.PrefillResponse:
        REQUEST_ID.set(request.request_id)  # this call's task: its log lines carry the id
        try:
            async with self.admit(RoleName.PREFILL):
                return await self._traced_prefill(request, context)
        except CallError as exc:
            await abort_with(context, exc)

    async def _traced_prefill(self, request: worker_pb2.PrefillRequest,
                              context: grpc.aio.ServicerContext) -> worker_pb2.PrefillResponse:
        with self.tracing.server_span("prefill", context, PREFILL_RPC) as span:
            reply = await self._prefill(request, context)
            if span.is_recording():
                span.set_attributes({"kvmesh.request_id": request.request_id,
                                     "kvmesh.prompt_tokens": len(request.token_ids),
                                     "kvmesh.cached_tokens": reply.cached_tokens})
            return reply

    async def _prefill(self, request: worker_pb2.PrefillRequest,
                       context: grpc.aio.ServicerContext) -> worker_pb2.PrefillResponse:
        engine_request = EngineRequest(request.request_id, list(request.token_ids), sampling_from_proto(request.sampling))
        try:
            result = await self.engine.prefill(engine_request)
        except NotImplementedError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except EngineBusy as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ValueError as exc:
            await abort_with(context, refused(exc))
        log.info("request %s: prefilled %d tokens (%d cached) for remote decode", request.request_id,
                 len(request.token_ids), result.cached_tokens)
        return worker_pb2.PrefillResponse(kv_transfer_json=json.dumps(result.kv_transfer),
                                          cached_tokens=result.cached_tokens)

    async def ReleaseKv(self, request: worker_pb2.ReleaseKvRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> worker_pb2.ReleaseKvResponse:
        with self.tracing.server_span("release kv", context, RELEASE_RPC) as span:
            released = await self.engine.release_kv(request.request_id)
            if span.is_recording():
                span.set_attributes({"kvmesh.request_id": request.request_id, "kvmesh.released": released})
        if released:
            log.info("request %s: KV released, its decode side gave up", request.request_id)
        return worker_pb2.ReleaseKvResponse(released=released)
