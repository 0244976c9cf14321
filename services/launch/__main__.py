"""python -m services.launch: a whole local mesh (etcd, router, processor, workers, frontend).

The launcher is assembled like every service: each child is registered with the service runner
as it starts, so a signal, a start-up failure or a crash stops them all in reverse start order
(the frontend first, etcd last).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx

from services.launch.children import Child, child_env, python_module
from services.launch.config import LaunchConfig, load
from services.launch.etcd_child import EtcdChild
from services.mesh.service_runner import ServiceRunner, run_service
from services.tools.make_demo_model import ensure_demo_model

HEALTH_POLL_S = 0.25
# Beyond its drain timeout, what a child gets to exit after SIGTERM before it is killed.
CHILD_EXIT_MARGIN_S = 10.0
EXIT_FAILED = 1
# A child that exits is started again after this, doubling up to the maximum while it keeps dying.
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0


def plan_children(cfg: LaunchConfig, etcd: str, model: str) -> list[Child]:
    """The mesh's processes in start order (the frontend last, so /health means the rest is up).

    With prefill workers, decode and prefill workers exchange KV over NIXL and the decode workers
    apply the conditional disaggregation rule; with --prefill-workers 0 serving is aggregated.
    """
    common = ["--etcd-endpoints", etcd, "--namespace", cfg.namespace, "--log-level", cfg.log_level,
              "--drain-timeout", str(cfg.drain_timeout_s)]
    named = ["--served-model-name", cfg.served_model_name] if cfg.served_model_name else []
    env = child_env()
    children = [Child("kv-router", python_module("services.kv_router", *common, *cfg.router_argv), env)
                for _ in range(cfg.routers)]
    children += [Child("processor", python_module("services.processor", *common, "--model", model, *named,
                                                  *cfg.processor_argv), env)
                 for _ in range(cfg.processors)]
    engine = [*common, "--model", model, *named, *cfg.engine_argv]
    decode = [*engine, *cfg.disagg_argv]
    if cfg.disaggregated:
        decode += ["--kv-transfer", "nixl", "--remote-prefill"]
    children += _workers("decode-worker", "services.decode_worker", decode, cfg.decode_workers, cfg.engine, env)
    if cfg.disaggregated:
        children += _workers("prefill-worker", "services.prefill_worker", [*engine, "--kv-transfer", "nixl"],
                             cfg.prefill_workers, cfg.engine, env)
    frontend = python_module("services.frontend", *common, *cfg.frontend_argv)
    children.append(Child("frontend", frontend, child_env({"KVMESH_API_KEY": cfg.api_key} if cfg.api_key else None)))
    return children


def _workers(component: str, module: str, flags: list[str], count: int, engine: str,
             env: dict[str, str]) -> list[Child]:
    marker = f"{component} ready:"
    if engine == "mocker":
        # Mocker workers are cheap: one process hosts them all, each registered on its own.
        return [Child(component, python_module(module, *flags, "--num-workers", str(count)), env, marker)]
    return [Child(component, python_module(module, *flags), env, marker) for _ in range(count)]


async def wait_ready(base: str, children: list[Child], timeout_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    reason = "no answer yet"
    async with httpx.AsyncClient(timeout=2.0) as client:
        while asyncio.get_running_loop().time() < deadline:
            for child in children:
                if child.returncode is not None:
                    raise RuntimeError(
                        f"{child.component} exited with code {child.returncode} during start-up; its last lines:\n  "
                        + "\n  ".join(child.tail))
            waiting_for = [c.component for c in children if c.ready_marker and not c.ready]
            if waiting_for:
                reason = "waiting for " + ", ".join(sorted(set(waiting_for)))
                await asyncio.sleep(HEALTH_POLL_S)
                continue
            try:
                reply = await client.get(f"{base}/health")
                if reply.status_code == 200:
                    return
                reason = reply.json().get("reason", reply.text)
            except (httpx.HTTPError, ValueError) as exc:
                reason = type(exc).__name__
            await asyncio.sleep(HEALTH_POLL_S)
    raise TimeoutError(f"the mesh was not healthy within {timeout_s:.0f}s: {reason}")


async def start_child(runner: ServiceRunner, child: Child, drain_timeout_s: float) -> None:
    """Starts a child; at teardown it gets SIGTERM, its drain timeout to finish, then SIGKILL."""
    await child.start()
    stop_s = drain_timeout_s + CHILD_EXIT_MARGIN_S
    runner.on_teardown(f"stop {child.component}", lambda: child.stop(stop_s), stop_s + 5)


async def assemble(runner: ServiceRunner, cfg: LaunchConfig) -> None:
    if cfg.prefill_workers and not cfg.remote_prefill:
        print("note: --no-remote-prefill: the prefill workers would get no work; not starting them",
              file=sys.stderr, flush=True)
    try:
        model = str(Path(cfg.model).resolve()) if cfg.model else str(ensure_demo_model())
        endpoint = cfg.etcd_endpoints
        if not endpoint:
            etcd = EtcdChild()
            runner.on_teardown("stop etcd", etcd.stop, CHILD_EXIT_MARGIN_S + 5)
            await etcd.start()
            endpoint = etcd.endpoint
        children = plan_children(cfg, endpoint, model)
        for child in children:
            await start_child(runner, child, cfg.drain_timeout_s)
        base = f"http://127.0.0.1:{cfg.http_port}"
        await wait_ready(base, children, cfg.ready_timeout_s)
    except (RuntimeError, TimeoutError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_FAILED) from None
    print(f"READY {base}/v1", flush=True)
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
            print(f"{child.component} pid={pid} exited with code {code}; stopping the mesh (--on-child-exit exit)",
                  file=sys.stderr, flush=True)
            return
        if asyncio.get_running_loop().time() - started > RESTART_BACKOFF_MAX_S:
            backoff = RESTART_BACKOFF_S  # it ran a good while: a fresh failure, not a crash loop
        print(f"{child.component} pid={pid} exited with code {code}; restarting it in {backoff:.0f}s",
              file=sys.stderr, flush=True)
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, RESTART_BACKOFF_MAX_S)
        await child.start()


def main() -> None:
    cfg = load()
    run_service("launch", None, lambda runner: assemble(runner, cfg))


if __name__ == "__main__":
    main()
