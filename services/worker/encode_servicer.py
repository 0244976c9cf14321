"""An encode worker's `Encoder` service (E/P/D): one image encoded and its features held for the
caller (the engine's `encode`: the mocker's in its NIXL arena, vLLM's in the shared directory).

Each worker also keeps the time its encoder had an image in hand (`EncoderBusy`), exported with
the images it encoded as `kvmesh_encoder_busy_seconds_total` and `kvmesh_encoder_images_total`:
the planner's measure of what an image costs the encode pool (services/planner/encode_pool.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator

import grpc
from prometheus_client.core import CounterMetricFamily

from gen.kvmesh.v1 import worker_pb2, worker_pb2_grpc
from services.engines.base import Engine
from services.mesh.grpc_server import as_unary_rpc
from services.mesh.logs import REQUEST_ID
from services.worker.kv_pull import kv_pull_to_proto
from services.worker.servicer import engine_refusals, media_from_proto

log = logging.getLogger(__name__)

ENCODER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Encoder"].full_name


class EncoderBusy:
    """The seconds the encoder had at least one image in hand (overlapping calls counted once: an
    engine that batches them is busy once), and the images it encoded."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._running = 0
        self._since = 0.0
        self._closed_s = 0.0
        self.images = 0

    def begin(self) -> None:
        if self._running == 0:
            self._since = self._clock()
        self._running += 1

    def end(self, encoded: bool) -> None:
        self._running -= 1
        self.images += int(encoded)
        if self._running == 0:
            self._closed_s += self._clock() - self._since

    def seconds(self) -> float:
        """Up to now, the call under way included (a worker busy all along shows it at once)."""
        return self._closed_s + (self._clock() - self._since if self._running else 0.0)


class EncoderBusyCollector:
    """Every encode worker of the process, each by its instance id."""

    def __init__(self, workers: Callable[[], Iterable[tuple[str, EncoderBusy]]]) -> None:
        self._workers = workers

    def collect(self) -> Iterator[CounterMetricFamily]:
        busy = CounterMetricFamily("kvmesh_encoder_busy_seconds", "seconds the encoder had an image in hand",
                                   labels=["worker_id"])
        images = CounterMetricFamily("kvmesh_encoder_images", "images the encode worker encoded (or found in its "
                                     "encoder cache) for a caller", labels=["worker_id"])
        for worker_id, load in self._workers():
            busy.add_metric([worker_id], load.seconds())
            images.add_metric([worker_id], load.images)
        yield busy
        yield images


class EncoderServicer(worker_pb2_grpc.EncoderServicer):
    def __init__(self, engine: Engine, busy: EncoderBusy | None = None) -> None:
        self.engine = engine
        self.busy = busy or EncoderBusy()

    async def Encode(self, request: worker_pb2.EncodeRequest,  # noqa: N802
                     context: grpc.aio.ServicerContext) -> worker_pb2.EncodeResponse:
        return await as_unary_rpc(context, self.encode(request))

    async def encode(self, request: worker_pb2.EncodeRequest) -> AsyncIterator[worker_pb2.EncodeResponse]:
        REQUEST_ID.set(request.request_id)
        (item,) = media_from_proto([request.item], request.item.span.offset + request.item.span.length)
        self.busy.begin()
        encoded = None
        try:
            with engine_refusals():
                encoded = await self.engine.encode(request.request_id, item)
        finally:
            self.busy.end(encoded is not None)
        log.info("request %s: image %016x %s (%d tokens), its features held for a pull", request.request_id,
                 item.span.digest, "found in the encoder cache" if encoded.cached else "encoded", item.span.length)
        yield worker_pb2.EncodeResponse(features=kv_pull_to_proto(encoded.features), cached=encoded.cached)
