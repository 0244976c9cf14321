"""Images encoded on the encode pool (E/P/D) before a prompt is prefilled here.

Before its engine prefills a prompt with images, a worker asks its engine which images it would
encode itself (none in its encoder cache, not all in cached blocks), and has each of those of at
least `min_tokens` placeholders encoded by an encode worker, whose features its engine then
takes (the mocker pulls them over NIXL into its encoder cache; vLLM reads them from the directory
the encode workers write, vllm_encode.py); smaller images are encoded in place (not worth a round
trip). Each image goes to the encode worker its digest ranks first (rendezvous hashing over the
live pool), so a screenshot resent turn after turn finds its features in that worker's encoder
cache, whichever worker prefills it. Anything that fails (no encode worker, an unreachable or slow one, a pull
that fails its checksum) leaves that image to the engine, which encodes it in place: counted and
logged, never an error for the request.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import grpc
import xxhash
from prometheus_client import CollectorRegistry, Counter

from gen.kvmesh.v1 import worker_pb2, worker_pb2_grpc
from services.config_error import ConfigError
from services.engines.base import Engine, EngineRequest, MediaInput
from services.mesh.channels import ChannelPool
from services.mesh.config_error import validated
from services.mesh.discovery import ENCODE_WORKER, InstanceInfo
from services.mesh.recent_failures import RecentFailures
from services.mesh.service_runner import ServiceRunner
from services.worker.kv_pull import kv_pull_from_proto
from services.worker.servicer import media_to_proto

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EncodeConfig:
    # Images of fewer placeholder tokens are encoded in place (--min-remote-encode-tokens).
    min_tokens: int = 0
    # One image's encoding and pull, at most (--encode-timeout).
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.min_tokens < 0:
            raise ConfigError(f"--min-remote-encode-tokens must be >= 0, got {self.min_tokens}")
        if not self.timeout_s > 0:
            raise ConfigError(f"--encode-timeout must be > 0, got {self.timeout_s}")


class Members(Protocol):
    @property
    def instances(self) -> Mapping[str, InstanceInfo]: ...


class EncodeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.images = Counter("kvmesh_remote_encodes", "images of prompts prefilled here, by where their features "
                              "came from: remote (an encode worker encoded them), remote_cached (its encoder cache "
                              "held them), or the reason they were encoded in place", ["outcome"], registry=registry)


class RemoteEncoder:
    def __init__(self, config: EncodeConfig, encoders: Members, channels: ChannelPool, metrics: EncodeMetrics) -> None:
        self.config = config
        self._encoders = encoders
        self._channels = channels
        self._metrics = metrics
        self._failed = RecentFailures()

    async def prepare(self, engine: Engine, request: EngineRequest) -> None:
        """Has the request's images encoded on the encode pool, where worthwhile; returns once
        each is in the engine's encoder cache or left to the engine."""
        items = [item for item in engine.to_encode(request) if item.span.length >= self.config.min_tokens]
        if not items:
            return
        failing = set(self._failed.current())
        live = [w for w in self._encoders.instances.values() if w.instance_id not in failing]
        if not live:
            self._fallback(request.request_id, "no_encode_worker", len(items), "no encode worker is registered")
            return
        await asyncio.gather(*(self._one(engine, request.request_id, item, live) for item in items))

    async def _one(self, engine: Engine, rid: str, item: MediaInput, live: list[InstanceInfo]) -> None:
        worker = max(live, key=lambda w: xxhash.xxh3_64_intdigest(f"{w.instance_id}:{item.span.digest}".encode()))
        stub = worker_pb2_grpc.EncoderStub(self._channels.get(worker.address))
        try:
            async with asyncio.timeout(self.config.timeout_s):
                reply = await stub.Encode(worker_pb2.EncodeRequest(request_id=rid, item=media_to_proto(item)))
                await engine.take_features(item, kv_pull_from_proto(reply.features))
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self._failed.add(worker.instance_id)
            self._fallback(rid, "encode_failed", 1, f"encode worker {worker.instance_id}: {exc.code().name} "
                                                    f"{exc.details()}")
            return
        except TimeoutError:
            self._failed.add(worker.instance_id)
            self._fallback(rid, "timeout", 1, f"encode worker {worker.instance_id} took over {self.config.timeout_s}s")
            return
        except Exception as exc:  # noqa: BLE001 - a pull that fails any way leaves the image to the engine
            self._fallback(rid, "transfer", 1, f"features from {worker.instance_id} unusable: {exc}")
            return
        self._metrics.images.labels("remote_cached" if reply.cached else "remote").inc()

    def _fallback(self, rid: str, reason: str, images: int, why: str) -> None:
        self._metrics.images.labels(reason).inc(images)
        log.warning("request %s: %d image(s) encoded in place: %s", rid, images, why)



async def remote_encoder(kv_transfer: str, args: argparse.Namespace, runner: ServiceRunner,
                         registry: CollectorRegistry) -> RemoteEncoder | None:
    """A worker process's client of the encode pool; None for one that can take no features (the
    mocker's come over NIXL, vLLM's through --encoder-cache-dir): its images are encoded in place."""
    if kv_transfer != "nixl" and not args.encoder_cache_dir:
        return None
    config = validated(lambda: EncodeConfig(args.min_remote_encode_tokens, args.encode_timeout))
    return RemoteEncoder(config, await runner.watch_component(ENCODE_WORKER), runner.channels,
                         EncodeMetrics(registry))
