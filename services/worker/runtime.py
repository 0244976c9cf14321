"""Where an engine worker is assembled: engine, gRPC services, etcd registration, metrics.

One process can host several independent workers (`--num-workers`, mocker only), each with its
own server, lease and instance id, so scale tests do not need a process per worker. Roles differ
only in what `Role.prepare` sets up once per process and the services its factory mounts.

Start order — each worker's engine, servicer and gRPC server, then the leases of all of them
together — makes the service runner's reverse teardown deregister every worker first (peers
stop choosing them), then, worker by worker, end the endless subscription streams, let
generations in flight finish within the drain timeout, and stop the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import asyncio
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from grpc_health.v1 import health
from prometheus_client import CollectorRegistry

from gen.kvmesh.v1 import worker_pb2, worker_pb2_grpc
from services.engines.base import Engine
from services.engines.lora import AdapterError
from services.mesh.discovery import InstanceInfo, new_instance_id
from services.mesh.flags import (
    FlagParser,
    MeshConfig,
    add_mesh_flags,
    die,
    exit_if_checking,
    mesh_config,
    port_number,
    positive_int,
)
from services.mesh.grpc_server import ServiceBinding
from services.mesh.logs import LogComponent, setup_logging
from services.mesh.service_runner import ServiceRunner, run_service
from services.mesh.tracing import TRACING_OFF, Tracing, start_tracing
from services.contract.worker_roles import RoleName
from services.worker.engine_factory import build_engine
from services.worker.engine_health import watch_engine
from services.worker.engine_flags import EngineConfig, add_engine_flags, add_kv_transfer_flag, engine_config
from services.worker.kv_event_log import KvEventLog
from services.worker.load_collector import WorkerLoadCollector
from services.worker.lora_adapters import check_startup_adapters, known_adapters, register_runtime_adapters
from services.worker.lora_collector import WorkerLoraCollector
from services.mesh.instance_record import InstanceRecord
from services.worker.role_switch import RoleSwitch
from services.worker.servicer import WorkerServicer

log = logging.getLogger(__name__)

# vLLM shuts its engine processes down in seconds; past this the teardown moves on.
ENGINE_STOP_S = 30.0
WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


@dataclass(frozen=True)
class WorkerContext:
    """What a role may use to set itself up, once per process."""

    args: argparse.Namespace
    mesh: MeshConfig
    runner: ServiceRunner
    registry: CollectorRegistry
    engine: EngineConfig
    # The process's tracing, for the servicers a role builds (off unless OTEL_* asks).
    tracing: Tracing = TRACING_OFF
    # The component the process's log lines name (a switchable worker's follows its role).
    log_component: LogComponent = field(default_factory=lambda: LogComponent("worker"))


@dataclass(frozen=True)
class WorkerServices:
    """The servicers one worker mounts: the `Worker` service and any role-specific ones."""

    worker: WorkerServicer
    extra: tuple[ServiceBinding, ...] = ()
    # A worker that can change role: it says which pool it joins first and learns its registration.
    switch: RoleSwitch | None = None
    # The drain's step before the server stops taking calls (a decode worker's moves, handoff.py).
    drain: Callable[[], Awaitable[None]] | None = None


ServicesFactory = Callable[[Engine, str, KvEventLog], WorkerServices]


@dataclass(frozen=True)
class Role:
    component: str
    name: RoleName
    # Sets up what the role's workers share in this process; returns how to build each one's services.
    prepare: Callable[[WorkerContext], Awaitable[ServicesFactory]]
    add_flags: Callable[[argparse.ArgumentParser], object] | None = None
    default_kv_transfer: str = "none"
    # Validates the role's own flags up front, so `--check-config` and a bad flag fail before
    # anything starts (`prepare` builds them again from the same arguments).
    check_flags: Callable[[argparse.Namespace, EngineConfig], object] | None = None


@dataclass
class _Running:
    instance_id: str
    engine: Engine
    # The worker's etcd record, its one owner (adapters loaded and role switches change it).
    record: InstanceRecord
    lease_keys: dict[str, bytes]
    health: health.HealthServicer
    events: KvEventLog
    switch: RoleSwitch | None = None

    def role(self, started_as: Role) -> RoleName:
        return started_as.name if self.switch is None else self.switch.registered_role


def worker_parser(role: Role) -> FlagParser:
    parser = FlagParser(prog=f"python -m services.{role.component.replace('-', '_')}")
    add_mesh_flags(parser)
    add_engine_flags(parser)
    add_kv_transfer_flag(parser, role.default_kv_transfer)
    parser.add_argument("--num-workers", type=positive_int, default=1,
                        help="independent workers in this process (mocker only)")
    parser.add_argument("--port", type=port_number, default=0, help="gRPC port of the first worker (0 = any free)")
    parser.add_argument("--metrics-port", type=port_number, default=0, help="Prometheus port (0 = any free)")
    parser.add_argument("--kv-event-buffer", type=positive_int, default=65536,
                        help="KV events kept for subscribers that resume; older ones get a full snapshot")
    parser.add_argument("--kv-events", choices=("on", "off"), default="on",
                        help="off: publish no KV events and say so in the etcd record (routers predict this worker's "
                             "cache from the prompts they send it)")
    if role.add_flags is not None:
        role.add_flags(parser)
    return parser


async def start_worker(role: Role, ctx: WorkerContext, make_services: ServicesFactory, port: int,
                       metrics_port: int) -> _Running:
    runner, mesh, spec = ctx.runner, ctx.mesh, ctx.engine
    instance_id = new_instance_id()
    publishes = ctx.args.kv_events == "on"
    # In a thread: a NIXL agent's UCX start-up blocks for seconds (6 s seen on a 2-core machine),
    # long enough for this process's etcd watches, already open, to time out meanwhile.
    try:
        built = await asyncio.to_thread(build_engine, spec, instance_id, runner.store, mesh.namespace,
                                        kv_events=publishes)
    except AdapterError as exc:  # a --lora-modules adapter the engine, registering them, cannot use
        die(f"--lora-modules: {exc}")
    events = KvEventLog(capacity=ctx.args.kv_event_buffer)
    if publishes:
        built.engine.set_kv_event_sink(events.append)
    # Registered before the (slow) start: a stop during a vLLM load still stops what it started.
    runner.on_teardown(f"stop engine of {instance_id}", built.engine.stop, ENGINE_STOP_S)
    await built.engine.start()
    check_lora_served(built.engine, spec)
    await register_runtime_adapters(built.engine, runner.store, mesh.namespace, spec.served_model_name)
    services = make_services(built.engine, instance_id, events)
    runner.on_teardown(f"stop servicer of {instance_id}", services.worker.stop)
    binding = ServiceBinding(worker_pb2_grpc.add_WorkerServicer_to_server, services.worker, WORKER_SERVICE)
    bound, health_servicer = await runner.serve_grpc([binding, *services.extra], port)
    runner.on_teardown(f"end subscriptions to {instance_id}", services.worker.end_subscriptions)
    if services.drain is not None:
        runner.on_teardown(f"hand over the requests of {instance_id}", services.drain,
                           mesh.drain_timeout_s + ENGINE_STOP_S)
    switch = services.switch
    info = InstanceInfo(
        component=role.component if switch is None else switch.component,
        instance_id=instance_id,
        address=f"{mesh.advertise_host}:{bound}",
        model=spec.served_model_name,
        role=role.name if switch is None or switch.role is None else switch.role,
        block_size=spec.block_size,
        engine=spec.engine,
        metrics_port=metrics_port,
        switchable=switch is not None,
        kv_events=publishes,
        lora_adapters=known_adapters(built.engine),
        extra={"max_model_len": built.engine.info.max_model_len, "kv_transfer": spec.kv_transfer},
    )
    record = InstanceRecord(info, mesh.namespace)
    services.worker.record = record
    return _Running(instance_id, built.engine, record, built.lease_keys, health_servicer, events, switch)


def check_lora_served(engine: Engine, spec: EngineConfig) -> None:
    """A worker started with LoRA on an engine that serves no adapters stops with a line saying
    so. (The engine registers the `--lora-modules` adapters itself when built: one it cannot use
    fails `build_engine`.)"""
    if spec.lora.enabled and engine.adapters is None:
        die(f"--enable-lora: the {spec.engine} engine serves no LoRA adapters")


async def join_mesh(ctx: WorkerContext, workers: list[_Running]) -> None:
    """Registers the process's workers together (so a drain deregisters them together) and
    watches each one's engine."""
    sent = [w.record.info for w in workers]
    registrations = await ctx.runner.register_all([(info, w.lease_keys) for info, w in zip(sent, workers, strict=True)])
    for w, info, registration in zip(workers, sent, registrations, strict=True):
        await w.record.registered(registration, info)
        if w.switch is not None:
            w.switch.registered(w.record)
        ctx.runner.watch(asyncio.create_task(watch_engine(w.engine, w.health, w.instance_id),
                                             name=f"engine-health-{w.instance_id}"), f"the engine of {w.instance_id}")
        log.info("%s %s serving %s (%s, block size %d, KV transfer %s, LoRA adapters %s) at %s", info.component,
                 w.instance_id, ctx.engine.served_model_name, ctx.engine.engine, ctx.engine.block_size,
                 ctx.engine.kv_transfer, ",".join(w.record.info.lora_adapters) or "none", info.address)


def install_silence_drill(workers: list[_Running]) -> None:
    """SIGUSR2 toggles the KV event publication of every worker in the process, off then on: a
    drill for rehearsing a router's fallback to predicting the worker's cache (the streams stay
    open and say nothing, heartbeats included; see kv_event_log.py)."""

    def toggle() -> None:
        for w in workers:
            if w.events.silenced:
                w.events.publish()
            else:
                w.events.silence()
        state = "silenced (drill)" if workers and workers[0].events.silenced else "published again"
        log.warning("SIGUSR2: KV events of %s %s", " ".join(w.instance_id for w in workers), state)

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR2, toggle)


def start_reaper(runner: ServiceRunner) -> None:
    """The process that ends this worker's engine processes if the worker dies (see reaper.py)."""
    reaper = subprocess.Popen([sys.executable, "-m", "services.worker.reaper", str(os.getpid())],
                              stdin=subprocess.DEVNULL)

    def stop_reaper() -> None:
        # A clean shutdown stopped the engine already; the reaper has nothing left to do.
        reaper.terminate()
        try:
            reaper.wait(5)
        except subprocess.TimeoutExpired:
            reaper.kill()

    runner.on_teardown("stop the reaper", stop_reaper)


def main(role: Role, argv: list[str] | None = None) -> None:
    """A worker process of `role` from its command line (`argv`, default the process's own)."""
    args = worker_parser(role).parse_args(argv)
    mesh = mesh_config(args)
    log_component = setup_logging(mesh.log_level, role.component, mesh.log_format)
    if args.num_workers > 1 and args.engine != "mocker":
        die("--num-workers > 1 needs --engine mocker (one vLLM engine per process)")
    spec = engine_config(args, mesh.advertise_host)
    if role.name == RoleName.ENCODE:  # its engine runs the image encoder for the others (E/P/D)
        spec = dataclasses.replace(spec, encodes=True)
    if role.check_flags is not None:
        role.check_flags(args, spec)
    try:
        check_startup_adapters(spec.lora)
    except AdapterError as exc:
        die(f"--lora-modules: {exc}")
    exit_if_checking(args)

    async def assemble(runner: ServiceRunner) -> None:
        tracing = start_tracing(runner)  # first: torn down last, after the drain's last spans
        if spec.engine == "vllm":
            start_reaper(runner)
        await runner.connect_store()
        workers: list[_Running] = []
        registry = CollectorRegistry()
        registry.register(WorkerLoadCollector(lambda: [(w.instance_id, w.role(role), w.engine.load()) for w in workers]))
        registry.register(WorkerLoraCollector(lambda: [(w.instance_id, w.role(role), w.engine.adapters)
                                                       for w in workers if w.engine.adapters is not None]))
        metrics_port = runner.serve_metrics(registry, args.metrics_port)
        ctx = WorkerContext(args, mesh, runner, registry, spec, tracing, log_component)
        make_services = await role.prepare(ctx)
        for i in range(args.num_workers):
            port = args.port + i if args.port else 0
            workers.append(await start_worker(role, ctx, make_services, port, metrics_port))
        await join_mesh(ctx, workers)
        install_silence_drill(workers)
        # The launcher and the tests wait for this line.
        # A switchable worker says the pool it joined (`--start-as`).
        print(f"{workers[0].record.info.component} ready: " + " ".join(w.instance_id for w in workers), flush=True)

    run_service(role.component, mesh, assemble)
