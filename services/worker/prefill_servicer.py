"""The prefill worker's `Prefiller` service: run a prompt, hold its KV for a decode worker.

A prefill is a call on a session (`Prefiller.Session`, one stream per decode worker, as on every
hop of a request: the same frames, deadlines, cancellation and outcomes), or a unary `Prefill`
served by the same handler. It computes the prompt's KV and keeps it until the decode worker
that pulls it over NIXL is done, or until `ReleaseKv` says the decode side gave up (a hold also
expires on its own). Each call is a span (`prefill`, `release kv`) in the trace of the decode
worker that asked.

How a prefill ends, as the decode worker reads it (services/contract/outcomes.py, hop PREFILL):
an engine that cannot prefill for others is UNSUPPORTED, one holding all the KV it may is
NO_CAPACITY, a request it refuses BAD_REQUEST, a worker that left the prefill role PEER_DRAINING,
a prompt of a LoRA adapter the worker does not know MODEL_NOT_SERVED (lora_adapters.py).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from gen.kvmesh.v1 import worker_pb2, worker_pb2_grpc
from services.contract.worker_roles import RoleName
from services.engines.base import Engine, EngineRequest
from services.engines.lora import AdapterError
from services.mesh.grpc_server import as_unary_rpc
from services.mesh.logs import REQUEST_ID
from services.mesh.session_kind import PREFILL_SESSION, CallInfo, call_info
from services.mesh.session_server import SessionHub
from services.mesh.tracing import TRACING_OFF, Tracing
from services.worker.kv_pull import kv_pull_to_proto
from services.worker.lora_adapters import adapter_refused, check_adapter
from services.worker.remote_encode import RemoteEncoder
from services.worker.role_switch import Admit, always
from services.worker.servicer import engine_refusals, media_from_proto, sampling_from_proto

log = logging.getLogger(__name__)

PREFILLER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Prefiller"].full_name
PREFILL_RPC = "kvmesh.v1.Prefiller/Prefill"
RELEASE_RPC = "kvmesh.v1.Prefiller/ReleaseKv"


class PrefillServicer(worker_pb2_grpc.PrefillerServicer):
    """`admit` gates each call by role: a prefill worker admits every one, a worker that can switch
    roles only while it serves the prefill role."""

    def __init__(self, engine: Engine, tracing: Tracing = TRACING_OFF, admit: Admit = always,
                 encoder: RemoteEncoder | None = None) -> None:
        self.engine = engine
        self.tracing = tracing
        self.admit = admit
        # The encode pool's client (E/P/D), for the images of the prompts prefilled here.
        self.encoder = encoder
        # Decode workers' sessions: every prefill they ask for, served by `prefill`.
        self.sessions = SessionHub(PREFILL_SESSION, self.prefill)

    async def Session(self, frames: AsyncIterator[worker_pb2.PrefillSessionDown],  # noqa: N802
                      context: grpc.aio.ServicerContext) -> None:
        await self.sessions.serve(frames, context)

    async def Prefill(self, request: worker_pb2.PrefillRequest,  # noqa: N802
                      context: grpc.aio.ServicerContext) -> worker_pb2.PrefillResponse:
        return await as_unary_rpc(context, self.prefill(request, call_info(context)))

    async def prefill(self, request: worker_pb2.PrefillRequest, call: CallInfo) -> AsyncIterator[worker_pb2.PrefillResponse]:
        """One prefill, for a call on a session and for `Prefill` alike: one response."""
        REQUEST_ID.set(request.request_id)  # this call's task: its log lines carry the id
        async with self.admit(RoleName.PREFILL):
            with self.tracing.server_span("prefill", call, PREFILL_RPC) as span:
                reply = await self._prefill(request)
                if span.is_recording():
                    span.set_attributes({"kvmesh.request_id": request.request_id,
                                         "kvmesh.prompt_tokens": len(request.token_ids),
                                         "kvmesh.cached_tokens": reply.cached_tokens})
        yield reply

    async def _prefill(self, request: worker_pb2.PrefillRequest) -> worker_pb2.PrefillResponse:
        check_adapter(self.engine, request.lora_name)
        engine_request = EngineRequest(request.request_id, list(request.token_ids), sampling_from_proto(request.sampling),
                                       lora_name=request.lora_name,
                                       media=media_from_proto(request.media, len(request.token_ids)))
        if self.encoder is not None:
            await self.encoder.prepare(self.engine, engine_request)  # its images encoded on the encode pool
        try:
            with engine_refusals():
                result = await self.engine.prefill(engine_request)
        except AdapterError as exc:  # forgotten between the check and the engine's `use`
            raise adapter_refused(exc) from None
        log.info("request %s: prefilled %d tokens (%d cached%s) for remote decode", request.request_id,
                 len(request.token_ids), result.cached_tokens,
                 f", LoRA adapter {request.lora_name}" if request.lora_name else "")
        return worker_pb2.PrefillResponse(kv_pull=kv_pull_to_proto(result.kv_pull), cached_tokens=result.cached_tokens)

    async def ReleaseKv(self, request: worker_pb2.ReleaseKvRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> worker_pb2.ReleaseKvResponse:
        with self.tracing.server_span("release kv", context, RELEASE_RPC) as span:
            released = await self.engine.release_kv(request.request_id)
            if span.is_recording():
                span.set_attributes({"kvmesh.request_id": request.request_id, "kvmesh.released": released})
        if released:
            log.info("request %s: KV released, its decode side gave up", request.request_id)
        return worker_pb2.ReleaseKvResponse(released=released)
