"""The prefill worker's `Prefiller` service: run a prompt, hold its KV for a decode worker.

`Prefill` computes the prompt's KV and keeps it until the decode worker that pulls it over NIXL
is done, or until `ReleaseKv` says the decode side gave up (a hold also expires on its own).
"""

from __future__ import annotations

import json
import logging

import grpc

from gen.kvmesh.v1 import worker_pb2, worker_pb2_grpc
from services.engines.base import Engine, EngineRequest
from services.worker.servicer import sampling_from_proto

log = logging.getLogger(__name__)


class PrefillServicer(worker_pb2_grpc.PrefillerServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def Prefill(self, request: worker_pb2.PrefillRequest,  # noqa: N802
                      context: grpc.aio.ServicerContext) -> worker_pb2.PrefillResponse:
        engine_request = EngineRequest(request.request_id, list(request.token_ids), sampling_from_proto(request.sampling))
        try:
            result = await self.engine.prefill(engine_request)
        except NotImplementedError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        log.info("request %s: prefilled %d tokens (%d cached) for remote decode", request.request_id,
                 len(request.token_ids), result.cached_tokens)
        return worker_pb2.PrefillResponse(kv_transfer_json=json.dumps(result.kv_transfer),
                                          cached_tokens=result.cached_tokens)

    async def ReleaseKv(self, request: worker_pb2.ReleaseKvRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> worker_pb2.ReleaseKvResponse:
        released = await self.engine.release_kv(request.request_id)
        if released:
            log.info("request %s: KV released, its decode side gave up", request.request_id)
        return worker_pb2.ReleaseKvResponse(released=released)
