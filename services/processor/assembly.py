"""The processor's parts, assembled in a service runner: its own process (`python -m
services.processor`) or a gateway that hosts it (`python -m services.frontend --embed-processor`).

Either way it is the same processor: it serves the Processor gRPC service on its port (other
gateways' sessions, CountTokens), registers in etcd under its own lease and serves its metrics on
its own port; a hosting gateway also calls it in-process (services/mesh/local_session.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from gen.kvmesh.v1 import processor_pb2, processor_pb2_grpc
from services.contract.served_context import MAX_MODEL_LEN
from services.contract.worker_roles import RoleName
from services.mesh.config_error import validated
from services.mesh.discovery import DECODE_WORKER, PROCESSOR, ROUTER, ComponentView, InstanceInfo, new_instance_id
from services.mesh.etcd_lease import LeasedRegistration
from services.mesh.etcd_store import StoreUnavailable
from services.mesh.flags import MeshConfig, ModelRef, model_ref
from services.mesh.grpc_server import ServiceBinding
from services.mesh.instance_record import InstanceRecord
from services.mesh.service_runner import ServiceRunner
from services.mesh.tracing import Tracing
from services.processor.context_limit import ContextLimit
from services.processor.local_router import LocalRouter
from services.processor.output_parsers import OutputParsers
from services.processor.service import ProcessorConfig, ProcessorMetrics, ProcessorServicer
from services.processor.tokenizer import ModelTokenizer
from services.routing.admission.admission_metrics import AdmissionMetrics
from services.routing.admission.gate import Admission
from services.routing.admission.tenant_policy import PolicyFile
from services.routing.flags import admission_config, router_config, session_config
from services.routing.router import Router
from services.routing.router_client import RouterClient, Routes
from services.routing.router_metrics import KvTruthMetrics, RouterMetrics
from services.routing.session_store import follow_sessions
from services.routing.worker_pool import SYNC_TIMEOUT_S, WorkerPool

log = logging.getLogger("processor")


@dataclass(frozen=True)
class ProcessorSettings:
    """The model a processor serves and its settings, read from its flags and validated."""

    model: ModelRef
    config: ProcessorConfig


def processor_settings(args: argparse.Namespace) -> ProcessorSettings:
    """From the model and processor flags (services/mesh/flags.py, services/processor/flags.py)."""
    model = model_ref(args)
    return ProcessorSettings(model, validated(lambda: ProcessorConfig(
        served_model_name=model.served_model_name, request_timeout_s=args.request_timeout,
        migration_limit=args.migration_limit, default_max_tokens=args.default_max_tokens)))


@dataclass(frozen=True)
class StartedProcessor:
    servicer: ProcessorServicer
    info: InstanceInfo
    registration: LeasedRegistration


async def start_processor(runner: ServiceRunner, args: argparse.Namespace, settings: ProcessorSettings,
                          mesh: MeshConfig, tracing: Tracing, port: int, metrics_port: int) -> StartedProcessor:
    """Loads the tokenizer, follows the decode pool, routes (by the kv-router service or
    locally), serves gRPC on `port` and metrics on `metrics_port` (0: any free), and registers."""
    model, config = settings.model, settings.config
    tokenizer = ModelTokenizer(model.model_dir)
    await runner.connect_store()
    registry = CollectorRegistry()
    # The decode pool: the context length its workers serve is the one enforced (context_limit.py).
    decoders = await runner.watch_component(DECODE_WORKER)
    context = ContextLimit(config.served_model_name, tokenizer.config_context)
    context.follow(decoders)
    routers = await _routing(runner, args, registry, tracing, mesh.namespace, decoders)
    parsers = validated(lambda: OutputParsers(tokenizer.hf, args.tool_call_parser, args.reasoning_parser))
    servicer = ProcessorServicer(config, tokenizer, routers, runner.sessions, ProcessorMetrics(registry), tracing,
                                 parsers, context)
    binding = ServiceBinding(processor_pb2_grpc.add_ProcessorServicer_to_server, servicer,
                             processor_pb2.DESCRIPTOR.services_by_name["Processor"].full_name)
    bound, _ = await runner.serve_grpc([binding], port)
    served_metrics = runner.serve_metrics(registry, metrics_port)
    info = InstanceInfo(component=PROCESSOR, instance_id=new_instance_id(), address=f"{mesh.advertise_host}:{bound}",
                        model=config.served_model_name, metrics_port=served_metrics,
                        extra={MAX_MODEL_LEN: context.tokens})
    record = InstanceRecord(info, mesh.namespace)
    registration = await runner.register(info)
    await record.registered(registration, info)
    runner.watch(asyncio.create_task(_publish_context(context, record), name="publish context length"),
                 "publishing the context length")
    log.info("processor %s for %s at %s", info.instance_id, config.served_model_name, info.address)
    return StartedProcessor(servicer, info, registration)


async def _routing(runner: ServiceRunner, args: argparse.Namespace, registry: CollectorRegistry,
                   tracing: Tracing, namespace: str, decoders: ComponentView) -> Routes:
    """The routers over sessions, or (`--routing local`) this process's own decode pool index
    over `decoders`, synced with the workers' caches before the processor registers (as a router does)."""
    if args.routing == "service":
        client = RouterClient(await runner.watch_component(ROUTER), runner.sessions)
        runner.on_teardown("drop routing feedback not sent", client.close)
        return client
    config = router_config(args)
    pool = WorkerPool(decoders, runner.channels, config.kv_truth, KvTruthMetrics(registry))
    runner.on_teardown("stop decode worker subscriptions", pool.stop)
    late = await pool.wait_synced(SYNC_TIMEOUT_S)
    if late:
        log.warning("routing without the cached blocks of %d decode worker(s): %s", len(late), ", ".join(late))
    # The queue lives in each processor: with several, each admits its share (see gate.py).
    processors = await runner.watch_component(PROCESSOR)
    gate = Admission(pool, admission_config(args), AdmissionMetrics(registry),
                     validated(lambda: PolicyFile(args.tenant_policies)),
                     routers=lambda: max(1, len(processors.instances)))
    runner.watch(asyncio.create_task(gate.follow_policies(), name="tenant policies"), "tenant policies")
    bindings = await follow_sessions(runner, namespace, session_config(args))
    router = Router({RoleName.DECODE: pool}, config, RouterMetrics(registry), gate, bindings)
    return LocalRouter(router, tracing)


async def _publish_context(context: ContextLimit, record: InstanceRecord) -> None:
    """Keeps the processor's record's `max_model_len` at the context length it enforces. A write
    etcd does not take now is written by the next change (InstanceRecord), and the registration
    puts the record again when it registers anew after an outage."""
    async for tokens in context.changes():
        try:
            await record.update(extra={**record.info.extra, MAX_MODEL_LEN: tokens})
        except StoreUnavailable as exc:
            log.warning("could not publish the context length %d in etcd: %s", tokens, exc)
