"""python -m services.launch: a whole local mesh (etcd, router, processor, workers, frontend).

The launcher is assembled like every service: the children are registered with the service runner
as one teardown step, so a signal, a start-up failure or a crash stops them all: the frontend
first, then the rest together (supervision.py), etcd last. The console stays quiet (console.py
says what it shows); every child's full output goes to a file in the run directory (run_dir.py),
whose path comes first.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from gen.kvmesh.v1 import launcher_pb2_grpc

from services.launch.check_config import check_mesh
from services.launch.children import Child
from services.launch.config import LaunchConfig, load, with_demo_adapters
from services.launch.console import Console
from services.launch.etcd_child import EtcdChild
from services.contract.worker_roles import RoleName
from services.launch.plan import plan_children, worker_factory
from services.launch.readiness import wait_ready
from services.launch.run_dir import create_run_dir
from services.launch.supervision import CHILD_EXIT_MARGIN_S, ChildrenStop, supervise
from services.launch.worker_control import LAUNCHER_CONTROL_SERVICE, WorkerControl
from services.mesh.grpc_server import ServiceBinding, start_server
from services.mesh.flags import die
from services.mesh.service_runner import ServiceRunner, run_service
from services.tools.make_demo_model import ensure_demo_model

EXIT_FAILED = 1


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def assemble(runner: ServiceRunner, cfg: LaunchConfig, console: Console, run_dir: Path) -> None:
    if cfg.prefill_workers and not cfg.remote_prefill:
        console.note("note: --no-remote-prefill: the prefill workers would get no work; not starting them")
    try:
        model = str(Path(cfg.model).resolve()) if cfg.model else str(ensure_demo_model())
        served = with_demo_adapters(cfg)
        if served is not cfg:
            console.note("note: serving the demo LoRA adapters demo-lora-a and demo-lora-b (name one as the "
                         "request's model)")
        cfg = served
        endpoint = cfg.etcd_endpoints
        if not endpoint:
            etcd = EtcdChild(cfg.advertise_host, console=console, log_path=run_dir / "etcd.log")
            runner.on_teardown("stop etcd", etcd.stop, CHILD_EXIT_MARGIN_S + 5)
            await etcd.start()
            endpoint = etcd.endpoint
        children = plan_children(cfg, endpoint, model, console, run_dir)
        # A local planner's workers are started, supervised and stopped by the worker control.
        control = await start_worker_control(runner, cfg, worker_factory(cfg, endpoint, model, console, run_dir)) \
            if cfg.planner_switches else None
        stop = ChildrenStop(cfg.drain_timeout_s)
        runner.on_teardown("stop the mesh's processes", stop.stop_all, stop.teardown_s)
        for child in children:
            if control is not None and _is_worker(child):
                await control.start(RoleName(child.component.removesuffix("-worker")))
            else:
                await stop.start(child)
        children = [c for c in children if control is None or not _is_worker(c)]
        await wait_ready(f"http://{url_host(cfg.advertise_host)}:{cfg.health_port}/health", children,
                         cfg.ready_timeout_s)
    except (RuntimeError, TimeoutError, FileNotFoundError) as exc:
        console.note(f"error: {exc}")
        raise SystemExit(EXIT_FAILED) from None
    console.status(f"READY http://{url_host(cfg.advertise_host)}:{cfg.http_port}/v1")
    for child in children:
        supervise(runner, child, cfg.on_child_exit)


def _is_worker(child: Child) -> bool:
    """A prefill, decode or encode worker: with a local planner, started and stopped through the
    worker control."""
    return child.component.endswith("-worker")


async def start_worker_control(runner: ServiceRunner, cfg: LaunchConfig,
                               make_child: Callable[[RoleName], Child]) -> WorkerControl:
    """The workers a local planner starts and stops, and the loopback server it asks through."""
    control = WorkerControl(make_child, cfg.on_child_exit, cfg.drain_timeout_s, cfg.ready_timeout_s,
                            on_lost=lambda label: runner.request_stop(f"{label} ended", 1))
    runner.on_teardown("stop the workers", control.stop_all, cfg.drain_timeout_s + CHILD_EXIT_MARGIN_S + 5)
    binding = ServiceBinding(launcher_pb2_grpc.add_LauncherControlServicer_to_server, control,
                             LAUNCHER_CONTROL_SERVICE)
    server, _, _ = await start_server([binding], "127.0.0.1", cfg.control_port, tls=cfg.tls)
    runner.on_teardown("stop the launcher control server", lambda: server.stop(grace=1.0))
    return control


def main() -> None:
    cfg = load()
    if cfg.check_config:
        check_mesh(cfg)
    try:
        run_dir = create_run_dir(cfg.run_dir)
    except OSError as exc:
        die(f"--run-dir {cfg.run_dir}: cannot create it ({exc.strerror})")
    console = Console(cfg.verbose, transcript=run_dir / "launch.log")
    console.status(f"LOGS {run_dir}")
    run_service("launch", None, lambda runner: assemble(runner, cfg, console, run_dir))


if __name__ == "__main__":
    main()
