"""python -m services.launch: a whole local mesh (etcd, router, processor, workers, frontend).

The launcher is assembled like every service: each child is registered with the service runner
as it starts, so a signal, a start-up failure or a crash stops them all in reverse start order
(the frontend first, etcd last). The console stays quiet (console.py says what it shows); every
child's full output goes to a file in the run directory (run_dir.py), whose path comes first.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from services.launch.check_config import check_mesh
from services.launch.children import Child
from services.launch.config import LaunchConfig, load
from services.launch.console import Console
from services.launch.etcd_child import EtcdChild
from services.launch.plan import plan_children
from services.launch.readiness import wait_ready
from services.launch.run_dir import create_run_dir
from services.mesh.flags import die
from services.mesh.service_runner import ServiceRunner, run_service
from services.tools.make_demo_model import ensure_demo_model

# Beyond its drain timeout, what a child gets to exit after SIGTERM before it is killed.
CHILD_EXIT_MARGIN_S = 10.0
EXIT_FAILED = 1
# A child that exits is started again after this, doubling up to the maximum while it keeps dying.
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0


async def start_child(runner: ServiceRunner, child: Child, drain_timeout_s: float) -> None:
    """Starts a child; at teardown it gets SIGTERM, its drain timeout to finish, then SIGKILL."""
    await child.start()
    stop_s = drain_timeout_s + CHILD_EXIT_MARGIN_S
    runner.on_teardown(f"stop {child.component}", lambda: child.stop(stop_s), stop_s + 5)


async def assemble(runner: ServiceRunner, cfg: LaunchConfig, console: Console, run_dir: Path) -> None:
    if cfg.prefill_workers and not cfg.remote_prefill:
        console.note("note: --no-remote-prefill: the prefill workers would get no work; not starting them")
    try:
        model = str(Path(cfg.model).resolve()) if cfg.model else str(ensure_demo_model())
        endpoint = cfg.etcd_endpoints
        if not endpoint:
            etcd = EtcdChild(console=console, log_path=run_dir / "etcd.log")
            runner.on_teardown("stop etcd", etcd.stop, CHILD_EXIT_MARGIN_S + 5)
            await etcd.start()
            endpoint = etcd.endpoint
        children = plan_children(cfg, endpoint, model, console, run_dir)
        for child in children:
            await start_child(runner, child, cfg.drain_timeout_s)
        await wait_ready(f"http://127.0.0.1:{cfg.health_port}/health", children, cfg.ready_timeout_s)
    except (RuntimeError, TimeoutError, FileNotFoundError) as exc:
        console.note(f"error: {exc}")
        raise SystemExit(EXIT_FAILED) from None
    console.status(f"READY http://127.0.0.1:{cfg.http_port}/v1")
    for child in children:
        supervise(runner, child, cfg.on_child_exit)


def supervise(runner: ServiceRunner, child: Child, policy: str) -> None:
    """Watches a child after start-up. When it exits: `restart` starts it again after a back-off
    that doubles with each exit in quick succession (the rest of the mesh serves on meanwhile);
    `exit` stops the whole mesh with exit status 1."""
    task = asyncio.create_task(_keep_running(child, policy), name=f"supervise-{child.component}")
    runner.watch(task, f"the {child.component} process")


async def _keep_running(child: Child, policy: str) -> None:
    backoff = RESTART_BACKOFF_S
    while True:
        started = asyncio.get_running_loop().time()
        code = await child.wait()
        child.kill_leftovers()  # what the dead child started must not outlive it
        pid = child.process.pid if child.process else "?"
        if policy != "restart":
            child.console.note(f"{child.component} pid={pid} exited with code {code}; stopping the mesh "
                               "(--on-child-exit exit)")
            return
        if asyncio.get_running_loop().time() - started > RESTART_BACKOFF_MAX_S:
            backoff = RESTART_BACKOFF_S  # it ran a good while: a fresh failure, not a crash loop
        child.console.note(f"{child.component} pid={pid} exited with code {code}; restarting it in {backoff:.0f}s")
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, RESTART_BACKOFF_MAX_S)
        await child.start()


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
