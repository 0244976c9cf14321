"""python -m services.launch: a whole local mesh (etcd, router, processor, workers, frontend)."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import httpx

from services.common.lifecycle import run
from services.launch.children import Child, child_env, python_module
from services.launch.config import LaunchConfig, load
from services.launch.etcd_child import EtcdChild
from services.tools.make_demo_model import ensure_demo_model

HEALTH_POLL_S = 0.25


def _common_flags(cfg: LaunchConfig, etcd: str) -> list[str]:
    return ["--etcd-endpoints", etcd, "--namespace", cfg.namespace, "--log-level", cfg.log_level]


def _engine_flags(cfg: LaunchConfig, model: str) -> list[str]:
    flags = ["--engine", cfg.engine, "--model", model, "--num-gpu-blocks", str(cfg.num_gpu_blocks),
             "--speedup", str(cfg.speedup), "--timing", cfg.timing]
    if cfg.served_model_name:
        flags += ["--served-model-name", cfg.served_model_name]
    if cfg.block_size:
        flags += ["--block-size", str(cfg.block_size)]
    return flags


def plan_children(cfg: LaunchConfig, etcd: str, model: str) -> list[Child]:
    """The mesh's processes in start order (the frontend last, so /health means the rest is up).

    With prefill workers, decode and prefill workers exchange KV over NIXL and the decode workers
    apply the conditional disaggregation rule; with --prefill-workers 0 serving is aggregated.
    """
    common = _common_flags(cfg, etcd)
    env = child_env()
    children = [
        Child("kv-router", python_module("services.kv_router", *common, "--router-mode", cfg.router_mode), env),
    ]
    processor = python_module("services.processor", *common, "--model", model)
    if cfg.served_model_name:
        processor += ["--served-model-name", cfg.served_model_name]
    children.append(Child("processor", processor, env))
    engine = _engine_flags(cfg, model)
    disagg = cfg.prefill_workers > 0 and cfg.remote_prefill
    decode = [*common, *engine]
    if disagg:
        decode += ["--kv-transfer", "nixl", "--remote-prefill",
                   "--conditional-disagg" if cfg.conditional_disagg else "--no-conditional-disagg",
                   "--max-local-prefill-length", str(cfg.max_local_prefill_length),
                   "--max-prefill-queue-size", str(cfg.max_prefill_queue_size)]
    children += _workers("decode-worker", "services.decode_worker", decode, cfg.decode_workers, cfg.engine, env)
    if disagg:
        children += _workers("prefill-worker", "services.prefill_worker", [*common, *engine, "--kv-transfer", "nixl"],
                             cfg.prefill_workers, cfg.engine, env)
    frontend = python_module("services.frontend", *common, "--http-port", str(cfg.http_port))
    frontend_env = child_env({"KVMESH_API_KEY": cfg.api_key} if cfg.api_key else None)
    children.append(Child("frontend", frontend, frontend_env))
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


async def launch(cfg: LaunchConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if cfg.prefill_workers and not cfg.remote_prefill:
        print("note: --no-remote-prefill: the prefill workers would get no work; not starting them",
              file=sys.stderr, flush=True)
    model = str(Path(cfg.model).resolve()) if cfg.model else str(ensure_demo_model())
    etcd: EtcdChild | None = None
    children: list[Child] = []
    code = 0
    try:
        if cfg.etcd_endpoints:
            endpoint = cfg.etcd_endpoints
        else:
            etcd = EtcdChild()
            await etcd.start()
            endpoint = etcd.endpoint
        children = plan_children(cfg, endpoint, model)
        for child in children:
            await child.start()
        base = f"http://127.0.0.1:{cfg.http_port}"
        ready = asyncio.create_task(wait_ready(base, children, cfg.ready_timeout_s))
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait([ready, stopping], return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            return 130
        stopping.cancel()
        ready.result()
        print(f"READY {base}/v1", flush=True)
        code = await supervise(children, stop)
    except (RuntimeError, TimeoutError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        for child in reversed(children):
            await child.stop()
        if etcd is not None:
            await etcd.stop()
    return code


async def supervise(children: list[Child], stop: asyncio.Event) -> int:
    """Runs until Ctrl-C/SIGTERM; a dead worker is reported, any other dead child ends the mesh."""
    waits = {asyncio.create_task(c.wait()): c for c in children}
    stopping = asyncio.create_task(stop.wait())
    try:
        while True:
            done, _ = await asyncio.wait([*waits, stopping], return_when=asyncio.FIRST_COMPLETED)
            if stopping in done:
                return 0
            for task in done:
                child = waits.pop(task)
                print(f"{child.component} pid={child.process.pid if child.process else '?'} exited with code "
                      f"{task.result()}", file=sys.stderr, flush=True)
                if not child.component.endswith("worker"):
                    return 1
    finally:
        stopping.cancel()
        for task in waits:
            task.cancel()


def main() -> None:
    cfg = load()
    result = {"code": 0}

    async def amain() -> None:
        result["code"] = await launch(cfg)

    run(amain)
    raise SystemExit(result["code"])


if __name__ == "__main__":
    main()
