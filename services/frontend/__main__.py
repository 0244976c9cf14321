"""python -m services.frontend: the OpenAI-compatible REST gateway."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import uvicorn

from starlette.types import ASGIApp

from services.frontend.app import create_admin_app, create_app
from services.frontend.direct_write import DirectWriteProtocol
from services.frontend.flags import add_frontend_flags, frontend_config
from services.frontend.lora_admin import LoraAdmin
from services.frontend.mesh import LocalProcessor, MeshView
from services.frontend.metrics import FrontendMetrics
from services.frontend.request_tracing import RequestTracing
from services.mesh.discovery import (DECODE_WORKER, FRONTEND, PREFILL_WORKER, PROCESSOR, ROUTER, InstanceInfo,
                                     new_instance_id)
from services.mesh.etcd_lease import LeasedRegistration
from services.mesh.flags import (FlagParser, MeshConfig, add_mesh_flags, add_model_flags, die, exit_if_checking,
                                 mesh_config, port_number)
from services.mesh.local_session import LocalSession
from services.mesh.logs import setup_logging
from services.mesh.service_runner import ServiceRunner, run_service
from services.mesh.tracing import Tracing, start_tracing
from services.processor.assembly import ProcessorSettings, processor_settings, start_processor
from services.processor.flags import add_processor_flags
from services.routing.flags import add_router_flags

log = logging.getLogger("frontend")

# Connections the kernel queues before the gateway accepts them.
LISTEN_BACKLOG = 2048


def parser() -> FlagParser:
    p = FlagParser(prog="python -m services.frontend")
    add_mesh_flags(p)
    add_frontend_flags(p)
    hosted = p.add_argument_group(
        "embedded processor", "--embed-processor: this gateway hosts a processor and calls it in-process (one hop "
                              "fewer per request); the model, processor and routing flags below are the processor's")
    hosted.add_argument("--embed-processor", action="store_true",
                        help="host a processor in this process (it still serves gRPC and registers like any)")
    hosted.add_argument("--processor-port", type=port_number, default=0, help="the hosted processor's gRPC port")
    hosted.add_argument("--processor-metrics-port", type=port_number, default=0,
                        help="the hosted processor's Prometheus port (0 = any free)")
    add_model_flags(hosted)
    add_processor_flags(p)
    add_router_flags(p)
    return p


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the service runner decides when to exit."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind(host: str, port: int, flag: str = "--http-port", reuse_port: bool = False) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        # Only when asked: otherwise a second mesh started on a busy port would silently share it.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        die(f"{flag} {port}: cannot listen on {host}:{port} ({exc.strerror})")
    sock.listen(LISTEN_BACKLOG)
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> None:
    """The service's command line (`argv`, default the process's own): tests run `--check-config` in process."""
    args = parser().parse_args(argv)
    mesh = mesh_config(args)
    setup_logging(mesh.log_level, FRONTEND, mesh.log_format)
    config = frontend_config(args)
    # The hosted processor's settings are checked with the gateway's.
    hosted = processor_settings(args) if args.embed_processor else None
    if hosted is None and args.model is not None:
        die("--model is the embedded processor's: give --embed-processor too")
    exit_if_checking(args)
    sock = bind(mesh.host, args.http_port, reuse_port=args.reuse_port)
    admin_sock = None if config.metrics_port is None else bind(mesh.host, config.metrics_port, "--metrics-port")

    async def assemble(runner: ServiceRunner) -> None:
        tracing = start_tracing(runner)  # first: torn down last, after the drain's last spans
        await runner.connect_store()
        local, registration = (None, None) if hosted is None else await _embedded_processor(
            runner, args, mesh, tracing, hosted)
        view = MeshView(processors=await runner.watch_component(PROCESSOR),
                        routers=await runner.watch_component(ROUTER),
                        decoders=await runner.watch_component(DECODE_WORKER),
                        sessions=runner.sessions,
                        prefills=await runner.watch_component(PREFILL_WORKER), local=local)
        metrics = FrontendMetrics()
        runner.time_gc(metrics.registry)
        lora = LoraAdmin(view, runner.channels, store=runner.store, namespace=mesh.namespace)
        app = create_app(config, view, metrics, lora, runner.channels)
        if tracing.enabled:
            app = RequestTracing(app, tracing=tracing)
        if admin_sock is not None:
            # Started first, so stopped last: metrics stay scrapable while the public port drains.
            _serve_http(runner, create_admin_app(view, metrics), admin_sock, "the metrics port", 0)
        _serve_http(runner, app, sock, "the HTTP server", mesh.drain_timeout_s)
        port = sock.getsockname()[1]
        # Where /metrics is scraped (the planner reads the traffic there).
        metrics_port = port if admin_sock is None else admin_sock.getsockname()[1]
        info = InstanceInfo(component=FRONTEND, instance_id=new_instance_id(), address=f"{mesh.advertise_host}:{port}",
                            metrics_port=metrics_port)
        await runner.register(info)
        if registration is not None:
            # At a drain the hosted processor leaves etcd with the gateway (this runs first), so
            # other gateways stop sending it work while this one's HTTP answers finish; its
            # sessions are drained after them, with its gRPC server.
            runner.on_teardown("deregister the embedded processor", registration.stop)
        log.info("frontend %s listening on http://%s:%d/v1", info.instance_id, mesh.host, port)

    run_service(FRONTEND, mesh, assemble)


async def _embedded_processor(runner: ServiceRunner, args: argparse.Namespace, mesh: MeshConfig, tracing: Tracing,
                              settings: ProcessorSettings) -> tuple[LocalProcessor, LeasedRegistration]:
    """The processor this gateway hosts (services/processor/assembly.py), the in-process session
    its requests take to it (closed after the HTTP server has drained), and its registration."""
    started = await start_processor(runner, args, settings, mesh, tracing, args.processor_port,
                                    args.processor_metrics_port)
    info = started.info
    session = LocalSession(started.servicer.sessions, info.address, clock=runner.sessions.clock)
    runner.on_teardown("close the embedded processor's session", session.close)
    return LocalProcessor(info.instance_id, info.model, session), started.registration


def _serve_http(runner: ServiceRunner, app: ASGIApp, sock: socket.socket, label: str, drain_timeout_s: float) -> None:
    # log_config=None: uvicorn's records go through the process's own handler (text or JSON).
    server = _Server(uvicorn.Config(app, log_level="warning", log_config=None, access_log=False, http=DirectWriteProtocol,
                                    timeout_keep_alive=30, lifespan="off",
                                    timeout_graceful_shutdown=max(1, round(drain_timeout_s))))
    serving = runner.watch(asyncio.create_task(server.serve(sockets=[sock]), name=label), label)
    runner.on_teardown(f"stop {label}", lambda: _shut_down(server, serving), drain_timeout_s + 10)


async def _shut_down(server: uvicorn.Server, serving: asyncio.Task[None]) -> None:
    """Stops accepting and lets open responses finish (uvicorn's own graceful shutdown)."""
    server.should_exit = True
    await asyncio.gather(serving, return_exceptions=True)


if __name__ == "__main__":
    main()
