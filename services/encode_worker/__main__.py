"""python -m services.encode_worker: encodes images for the workers that prefill (E/P/D).

It registers like any worker (its own etcd component, `encode-worker`), and serves the `Encoder`
service: an image encoded, its features held in the engine's NIXL arena until the caller has
pulled them. The workers that prefill prompts with images ask it (services/worker/remote_encode.py)
and encode in place when none answers. The mocker holds features in its NIXL arena; vLLM (run
encoder-only) writes them to `--encoder-cache-dir` through its ECExampleConnector, where the
workers that prefill (its consumers) read them.
"""

from __future__ import annotations

import argparse

from gen.kvmesh.v1 import worker_pb2_grpc
from services.contract.worker_roles import RoleName
from services.engines.base import Engine
from services.mesh.discovery import ENCODE_WORKER
from services.mesh.flags import die
from services.mesh.grpc_server import ServiceBinding
from services.worker.encode_servicer import ENCODER_SERVICE, EncoderBusy, EncoderBusyCollector, EncoderServicer
from services.worker.engine_flags import EngineConfig
from services.worker.kv_event_log import KvEventLog
from services.worker.runtime import Role, ServicesFactory, WorkerContext, WorkerServices, main
from services.worker.servicer import WorkerServicer


async def prepare(ctx: WorkerContext) -> ServicesFactory:
    busy: dict[str, EncoderBusy] = {}
    ctx.registry.register(EncoderBusyCollector(lambda: list(busy.items())))

    def services(engine: Engine, worker_id: str, events: KvEventLog) -> WorkerServices:
        busy[worker_id] = EncoderBusy()
        encoder = ServiceBinding(worker_pb2_grpc.add_EncoderServicer_to_server,
                                 EncoderServicer(engine, busy[worker_id]), ENCODER_SERVICE)
        return WorkerServices(WorkerServicer(engine, worker_id, events, ctx.tracing), (encoder,))

    return services


def check_flags(args: argparse.Namespace, spec: EngineConfig) -> None:
    if spec.engine == "mocker" and spec.kv_transfer != "nixl":
        die("a mocker encode worker hands features over NIXL: leave --kv-transfer at nixl")
    if spec.engine == "vllm" and not spec.encoder_cache_dir:
        die("a vLLM encode worker writes image features to --encoder-cache-dir (the workers that prefill read them "
            "there): give it")


# A mocker encode worker without KV transfer could hand nothing over: NIXL is its default (vLLM's
# features go through --encoder-cache-dir instead: its worker takes --kv-transfer none).
ROLE = Role(ENCODE_WORKER, RoleName.ENCODE, prepare, check_flags=check_flags, default_kv_transfer="nixl")

if __name__ == "__main__":
    main(ROLE)
