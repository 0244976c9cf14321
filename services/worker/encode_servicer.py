"""An encode worker's `Encoder` service (E/P/D): one image encoded and its features held for the
caller (the engine's `encode`: the mocker's in its NIXL arena, vLLM's in the shared directory)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from gen.kvmesh.v1 import worker_pb2, worker_pb2_grpc
from services.engines.base import Engine
from services.mesh.grpc_server import as_unary_rpc
from services.mesh.logs import REQUEST_ID
from services.worker.kv_pull import kv_pull_to_proto
from services.worker.servicer import engine_refusals, media_from_proto

log = logging.getLogger(__name__)

ENCODER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Encoder"].full_name


class EncoderServicer(worker_pb2_grpc.EncoderServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def Encode(self, request: worker_pb2.EncodeRequest,  # noqa: N802
                     context: grpc.aio.ServicerContext) -> worker_pb2.EncodeResponse:
        return await as_unary_rpc(context, self.encode(request))

    async def encode(self, request: worker_pb2.EncodeRequest) -> AsyncIterator[worker_pb2.EncodeResponse]:
        REQUEST_ID.set(request.request_id)
        (item,) = media_from_proto([request.item], request.item.span.offset + request.item.span.length)
        with engine_refusals():
            encoded = await self.engine.encode(request.request_id, item)
        log.info("request %s: image %016x %s (%d tokens), its features held for a pull", request.request_id,
                 item.span.digest, "found in the encoder cache" if encoded.cached else "encoded", item.span.length)
        yield worker_pb2.EncodeResponse(features=kv_pull_to_proto(encoded.features), cached=encoded.cached)
