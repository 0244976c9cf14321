"""Runs engine workers as mesh members: engine, gRPC server, etcd registration, metrics.

One process can host several independent workers (`--num-workers`, mocker only), each with its
own server, lease and instance id, so scale tests do not need a process per worker. Decode and
prefill workers differ only in the servicer a `Role` builds.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from prometheus_client import CollectorRegistry

from gen.kvmesh.v1 import worker_pb2, worker_pb2_grpc
from services.common.config import FlagParser, MeshConfig, add_mesh_flags, die, mesh_config, positive_int, setup_logging
from services.common.discovery import InstanceInfo, new_instance_id
from services.common.etcd_lease import LeasedRegistration
from services.common.etcd_store import KeyValueStore
from services.common.grpc_server import ServiceBinding, start_server
from services.common.kv_event_log import KvEventLog
from services.common.lifecycle import connect_store, register_instance, run, stop_event_on_signals
from services.common.telemetry import WorkerLoadCollector, serve_metrics
from services.common.worker_servicer import WorkerServicer
from services.engines.base import Engine
from services.engines.factory import EngineSpec, add_engine_flags, build_engine, engine_spec
from services.engines.mocker.kv_transfer import NixlKvEndpoint, nixl_metadata_key

log = logging.getLogger(__name__)


@dataclass
class WorkerContext:
    """What a role's servicer may need beyond the engine."""

    args: argparse.Namespace
    mesh: MeshConfig
    store: KeyValueStore
    registry: CollectorRegistry
    spec: EngineSpec


ServicerFactory = Callable[[Engine, str, KvEventLog, WorkerContext], WorkerServicer]


@dataclass
class Role:
    component: str
    name: str
    make_servicer: ServicerFactory
    add_flags: Callable[[argparse.ArgumentParser], None] | None = None
    setup: Callable[[WorkerContext], object] | None = None  # async: shared per-process resources
    teardown: Callable[[], object] | None = None


@dataclass
class RunningWorker:
    instance_id: str
    engine: Engine
    server: grpc.aio.Server
    registration: LeasedRegistration
    servicer: WorkerServicer


def worker_parser(role: Role) -> argparse.ArgumentParser:
    parser = FlagParser(prog=f"python -m services.{role.component.replace('-', '_')}")
    add_mesh_flags(parser)
    add_engine_flags(parser)
    parser.add_argument("--num-workers", type=positive_int, default=1,
                        help="independent workers in this process (mocker only)")
    parser.add_argument("--port", type=int, default=0, help="gRPC port of the first worker (0 = any free)")
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0 = any free)")
    parser.add_argument("--kv-event-buffer", type=positive_int, default=65536,
                        help="KV events kept for subscribers that resume; older ones get a full snapshot")
    if role.add_flags is not None:
        role.add_flags(parser)
    return parser


async def start_worker(role: Role, ctx: WorkerContext, port: int, metrics_port: int) -> RunningWorker:
    spec, mesh, store = ctx.spec, ctx.mesh, ctx.store
    instance_id = new_instance_id()
    engine = build_engine(spec)
    extra_keys: dict[str, bytes] = {}
    if spec.kv_transfer == "nixl" and spec.engine == "mocker":
        endpoint = NixlKvEndpoint(instance_id, spec.kv_bytes_per_token)
        endpoint.metadata_lookup = lambda peer: store.get(nixl_metadata_key(mesh.namespace, peer))
        engine.kv_endpoint = endpoint  # type: ignore[attr-defined]
        # The agent's metadata lives and dies with this instance's lease (the seed's metadata store).
        extra_keys[nixl_metadata_key(mesh.namespace, instance_id)] = endpoint.metadata()
    events = KvEventLog(capacity=ctx.args.kv_event_buffer)
    engine.set_kv_event_sink(events.append)
    await engine.start()
    servicer = role.make_servicer(engine, instance_id, events, ctx)
    binding = ServiceBinding(
        worker_pb2_grpc.add_WorkerServicer_to_server, servicer, worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
    )
    server, bound, _health = await start_server([binding], mesh.host, port)
    info = InstanceInfo(
        component=role.component,
        instance_id=instance_id,
        address=f"{mesh.advertise_host}:{bound}",
        model=spec.served_model_name,
        role=role.name,
        block_size=spec.block_size,
        engine=spec.engine,
        metrics_port=metrics_port,
        extra={"max_model_len": engine.info.max_model_len, "kv_transfer": spec.kv_transfer},
    )
    registration = await register_instance(store, mesh.namespace, info, extra_keys)
    log.info("%s %s serving %s (%s, block size %d, KV transfer %s) at %s", role.component, instance_id,
             spec.served_model_name, spec.engine, spec.block_size, spec.kv_transfer, info.address)
    return RunningWorker(instance_id, engine, server, registration, servicer)


async def stop_worker(worker: RunningWorker) -> None:
    await worker.registration.stop()
    await worker.server.stop(grace=2)
    stop = getattr(worker.servicer, "stop", None)
    if stop is not None:
        await stop()
    await worker.engine.stop()


def main(role: Role) -> None:
    args = worker_parser(role).parse_args()
    mesh = mesh_config(args)
    setup_logging(mesh.log_level, role.component)
    if args.num_workers > 1 and args.engine != "mocker":
        die("--num-workers > 1 needs --engine mocker (one vLLM engine per process)")
    spec = engine_spec(args, mesh.advertise_host)

    async def amain() -> None:
        stop = stop_event_on_signals()
        store = await connect_store(mesh)
        workers: list[RunningWorker] = []
        registry = CollectorRegistry()
        registry.register(WorkerLoadCollector(lambda: [(w.instance_id, role.name, w.engine.load()) for w in workers]))
        metrics_port = serve_metrics(registry, mesh.host, args.metrics_port)
        ctx = WorkerContext(args, mesh, store, registry, spec)
        if role.setup is not None:
            await role.setup(ctx)  # type: ignore[misc]
        for i in range(args.num_workers):
            port = args.port + i if args.port else 0
            workers.append(await start_worker(role, ctx, port, metrics_port))
        print(f"{role.component} ready: " + " ".join(w.instance_id for w in workers), flush=True)
        await stop.wait()
        log.info("shutting down")
        await asyncio.gather(*(stop_worker(w) for w in workers), return_exceptions=True)
        if role.teardown is not None:
            await role.teardown()  # type: ignore[misc]
        await store.close()

    run(amain)
