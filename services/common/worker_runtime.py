"""Runs engine workers as mesh members: engine, gRPC server, etcd registration, metrics.

One process can host several independent workers (`--num-workers`, mocker only), each with its
own server, lease and instance id, so scale tests do not need a process per worker.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass

import grpc
from prometheus_client import CollectorRegistry

from gen.kvmesh.v1 import worker_pb2, worker_pb2_grpc
from services.common.config import MeshConfig, add_mesh_flags, die, mesh_config, positive_int, setup_logging
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

log = logging.getLogger(__name__)


@dataclass
class RunningWorker:
    instance_id: str
    engine: Engine
    server: grpc.aio.Server
    registration: LeasedRegistration
    servicer: WorkerServicer


def worker_parser(component: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m services.{component.replace('-', '_')}")
    add_mesh_flags(parser)
    add_engine_flags(parser)
    parser.add_argument("--num-workers", type=positive_int, default=1,
                        help="independent workers in this process (mocker only)")
    parser.add_argument("--port", type=int, default=0, help="gRPC port of the first worker (0 = any free)")
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0 = any free)")
    parser.add_argument("--kv-event-buffer", type=positive_int, default=65536,
                        help="KV events kept for subscribers that resume; older ones get a full snapshot")
    return parser


async def start_worker(
    spec: EngineSpec, component: str, role: str, store: KeyValueStore, mesh: MeshConfig, port: int, metrics_port: int,
    event_buffer: int,
) -> RunningWorker:
    instance_id = new_instance_id()
    engine = build_engine(spec)
    events = KvEventLog(capacity=event_buffer)
    engine.set_kv_event_sink(events.append)
    await engine.start()
    servicer = WorkerServicer(engine, instance_id, events)
    binding = ServiceBinding(
        worker_pb2_grpc.add_WorkerServicer_to_server, servicer, worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
    )
    server, bound, _health = await start_server([binding], mesh.host, port)
    info = InstanceInfo(
        component=component,
        instance_id=instance_id,
        address=f"{mesh.advertise_host}:{bound}",
        model=spec.served_model_name,
        role=role,
        block_size=spec.block_size,
        engine=spec.engine,
        metrics_port=metrics_port,
        extra={"max_model_len": engine.info.max_model_len},
    )
    registration = await register_instance(store, mesh.namespace, info)
    log.info("%s %s serving %s (%s, block size %d) at %s", component, instance_id, spec.served_model_name,
             spec.engine, spec.block_size, info.address)
    return RunningWorker(instance_id, engine, server, registration, servicer)


async def stop_worker(worker: RunningWorker) -> None:
    await worker.registration.stop()
    await worker.server.stop(grace=2)
    await worker.engine.stop()


def main(component: str, role: str) -> None:
    args = worker_parser(component).parse_args()
    mesh = mesh_config(args)
    setup_logging(mesh.log_level, component)
    if args.num_workers > 1 and args.engine != "mocker":
        die("--num-workers > 1 needs --engine mocker (one vLLM engine per process)")
    spec = engine_spec(args)

    async def amain() -> None:
        stop = stop_event_on_signals()
        store = await connect_store(mesh)
        workers: list[RunningWorker] = []
        registry = CollectorRegistry()
        registry.register(WorkerLoadCollector(lambda: [(w.instance_id, role, w.engine.load()) for w in workers]))
        metrics_port = serve_metrics(registry, mesh.host, args.metrics_port)
        for i in range(args.num_workers):
            port = args.port + i if args.port else 0
            workers.append(await start_worker(spec, component, role, store, mesh, port, metrics_port,
                                              args.kv_event_buffer))
        print(f"{component} ready: " + " ".join(w.instance_id for w in workers), flush=True)
        await stop.wait()
        log.info("shutting down")
        await asyncio.gather(*(stop_worker(w) for w in workers), return_exceptions=True)
        await store.close()

    run(amain)
