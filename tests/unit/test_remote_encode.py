"""The encode pool's client (services/worker/remote_encode.py), in-process: each image goes to the
encode worker its digest ranks first, whichever request carries it; small images and images the
engine holds stay home; every failure leaves the image to the engine, counted by its reason.
Encode workers are real gRPC servers here; the engines on both sides are scripted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc
import pytest
from prometheus_client import CollectorRegistry

from gen.kvmesh.v1 import worker_pb2, worker_pb2_grpc
from services.engines.base import EncodedImage, EngineRequest, MediaInput, Sampling
from services.kv_protocol.media import MediaSpan, media_digest
from services.mesh.channels import ChannelPool
from services.mesh.discovery import InstanceInfo
from services.worker.kv_pull import kv_pull_to_proto
from services.worker.remote_encode import EncodeConfig, EncodeMetrics, RemoteEncoder


def image(name: bytes, offset: int = 0, length: int = 18) -> MediaInput:
    return MediaInput(MediaSpan(media_digest(name), offset, length), name, "image/png", 8, 8)


@dataclass
class ScriptedEncodeWorker(worker_pb2_grpc.EncoderServicer):
    name: str
    hang: bool = False
    seen: list[int] = field(default_factory=list)

    async def Encode(self, request: worker_pb2.EncodeRequest,  # noqa: N802
                     context: grpc.aio.ServicerContext) -> worker_pb2.EncodeResponse:
        self.seen.append(request.item.span.digest)
        if self.hang:
            await asyncio.sleep(30)
        return worker_pb2.EncodeResponse(features=kv_pull_to_proto({"from": self.name,
                                                                    "digest": request.item.span.digest}))


@dataclass
class ScriptedEngine:
    """The engine side: which images it would encode, and the features it was handed."""

    holds: set[int] = field(default_factory=set)
    taken: list[dict] = field(default_factory=list)
    refuse_pulls: bool = False

    def to_encode(self, request: EngineRequest) -> list[MediaInput]:
        return [item for item in request.media if item.span.digest not in self.holds]

    async def take_features(self, item: MediaInput, features: dict) -> None:
        if self.refuse_pulls:
            raise RuntimeError("checksum mismatch")
        assert features["digest"] == item.span.digest
        self.taken.append(features)

    async def encode(self, request_id: str, item: MediaInput) -> EncodedImage:
        raise NotImplementedError


@dataclass
class Pool:
    instances: dict[str, InstanceInfo]


@asynccontextmanager
async def encode_pool(*workers: ScriptedEncodeWorker, config: EncodeConfig = EncodeConfig(timeout_s=1.0)
                      ) -> AsyncIterator[tuple[RemoteEncoder, CollectorRegistry]]:
    servers, instances = [], {}
    for worker in workers:
        server = grpc.aio.server()
        worker_pb2_grpc.add_EncoderServicer_to_server(worker, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        instances[worker.name] = InstanceInfo(component="encode-worker", instance_id=worker.name,
                                              address=f"127.0.0.1:{port}", model="m")
    channels = ChannelPool()
    registry = CollectorRegistry()
    try:
        yield RemoteEncoder(config, Pool(instances), channels, EncodeMetrics(registry)), registry
    finally:
        await channels.close()
        for server in servers:
            await server.stop(None)


def request(*media: MediaInput) -> EngineRequest:
    return EngineRequest("r1", list(range(100)), Sampling(), media=media)


def outcomes(registry: CollectorRegistry) -> dict[str, float]:
    names = ("remote", "remote_cached", "no_encode_worker", "encode_failed", "timeout", "transfer")
    return {n: v for n in names if (v := registry.get_sample_value("kvmesh_remote_encodes_total", {"outcome": n}))}


async def test_each_image_goes_to_the_worker_its_digest_ranks_first_whatever_the_request() -> None:
    workers = [ScriptedEncodeWorker(f"enc-{i}") for i in range(3)]
    images = [image(bytes([i]) * 10) for i in range(12)]
    async with encode_pool(*workers) as (encoder, registry):
        engine = ScriptedEngine()
        await encoder.prepare(engine, request(*images[:6]))  # type: ignore[arg-type]
        await encoder.prepare(engine, request(*images[6:], *images[:6]))  # type: ignore[arg-type]
    placed: dict[int, set[str]] = {}
    for w in workers:
        for digest in w.seen:
            placed.setdefault(digest, set()).add(w.name)
    assert all(len(names) == 1 for names in placed.values()), placed  # the same image, the same worker
    assert len({name for names in placed.values() for name in names}) >= 2  # and the pool shares the work
    assert len(engine.taken) == 18 and outcomes(registry) == {"remote": 18}


async def test_images_the_engine_holds_or_too_small_stay_home() -> None:
    worker = ScriptedEncodeWorker("enc-0")
    held, small, big = image(b"held"), image(b"small", length=4), image(b"big", length=64)
    async with encode_pool(worker, config=EncodeConfig(min_tokens=16, timeout_s=1.0)) as (encoder, registry):
        await encoder.prepare(ScriptedEngine(holds={held.span.digest}), request(held, small, big))  # type: ignore[arg-type]
    assert worker.seen == [big.span.digest] and outcomes(registry) == {"remote": 1}


async def test_no_encode_worker_leaves_the_images_to_the_engine() -> None:
    async with encode_pool() as (encoder, registry):
        engine = ScriptedEngine()
        await encoder.prepare(engine, request(image(b"a"), image(b"b")))  # type: ignore[arg-type]
    assert engine.taken == [] and outcomes(registry) == {"no_encode_worker": 2}


@pytest.mark.parametrize(("worker", "engine", "reason"), [
    (ScriptedEncodeWorker("enc-0", hang=True), ScriptedEngine(), "timeout"),
    (ScriptedEncodeWorker("enc-0"), ScriptedEngine(refuse_pulls=True), "transfer"),
])
async def test_a_failure_leaves_the_image_to_the_engine_counted_by_its_reason(
        worker: ScriptedEncodeWorker, engine: ScriptedEngine, reason: str) -> None:
    async with encode_pool(worker) as (encoder, registry):
        await asyncio.wait_for(encoder.prepare(engine, request(image(b"a"))), 5)  # type: ignore[arg-type]
    assert engine.taken == [] and outcomes(registry) == {reason: 1}


async def test_a_worker_that_timed_out_is_passed_over_for_a_while() -> None:
    stuck, fine = ScriptedEncodeWorker("enc-a", hang=True), ScriptedEncodeWorker("enc-b")
    images = [image(bytes([i]) * 5) for i in range(8)]
    async with encode_pool(stuck, fine) as (encoder, registry):
        engine = ScriptedEngine()
        await encoder.prepare(engine, request(*images))  # type: ignore[arg-type]
        served_first = len(engine.taken)
        await encoder.prepare(engine, request(*(image(bytes([i]) * 6) for i in range(8))))  # type: ignore[arg-type]
    assert served_first < 8 and len(engine.taken) == served_first + 8  # the second round all on enc-b
    assert outcomes(registry)["timeout"] == 8 - served_first
