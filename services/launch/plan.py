"""The mesh's processes: which children, in which order, with which command lines."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

from services.engines.cpu_cores import bind_env, core_shares, host_cores
from services.launch.children import Child, child_env, python_module
from services.launch.config import LaunchConfig
from services.launch.console import Console
from services.launch.readiness import ready_pattern
from services.launch.run_dir import log_names
from services.contract.worker_roles import RoleName


def plan_children(cfg: LaunchConfig, etcd: str, model: str, console: Console | None = None,
                  run_dir: Path | None = None) -> list[Child]:
    """The mesh's processes in start order (the frontend last, so /health means the rest is up).

    With prefill workers, decode and prefill workers exchange KV over NIXL and the decode workers
    apply the conditional disaggregation rule; with --prefill-workers 0 serving is aggregated.
    With `run_dir` each child's output goes to its own file there (see run_dir.py).
    """
    common = _common(cfg, etcd)
    named = ["--served-model-name", cfg.served_model_name] if cfg.served_model_name else []
    env = child_env()
    children = [_child("kv-router", python_module("services.kv_router", *common, *cfg.router_argv), env)
                for _ in range(cfg.routers)]
    processor_argv = ["--model", model, *named, *cfg.processor_argv, *cfg.router_argv]
    if not cfg.embed_processors:
        children += [_child("processor", python_module("services.processor", *common, *processor_argv), env)
                     for _ in range(cfg.processors)]
    if cfg.planner_switches:
        # Encode workers first: the workers that prefill find them when they join.
        children += [planned_worker(cfg, common, model, RoleName.ENCODE, env, run_dir)
                     for _ in range(cfg.encode_workers)]
        children += [planned_worker(cfg, common, model, RoleName.DECODE, env, run_dir)
                     for _ in range(cfg.decode_workers)]
        children += [planned_worker(cfg, common, model, RoleName.PREFILL, env, run_dir)
                     for _ in range(cfg.prefill_workers)]
    else:
        children += _fixed_workers(cfg, common, model, env, run_dir)
    if cfg.engine == "vllm":
        _share_cores([c for c in children if c.component.endswith("-worker")])
    if cfg.planner != "off":
        children.append(_child("planner", python_module("services.planner", *common, *_connector_argv(cfg),
                                                         *cfg.planner_argv), env))
    shared_port = ["--reuse-port"] if cfg.frontends > 1 and "--reuse-port" not in cfg.frontend_argv else []
    hosted = ["--embed-processor", *processor_argv] if cfg.embed_processors else []
    frontend = python_module("services.frontend", *common, *cfg.frontend_argv, *shared_port, *hosted)
    children += [_child("frontend", frontend, child_env({"KVMESH_API_KEY": cfg.api_key} if cfg.api_key else None))
                 for _ in range(cfg.frontends)]
    for child, name in zip(children, log_names([c.component for c in children]), strict=True):
        child.console = console or Console()
        child.log_path = None if run_dir is None else run_dir / name
    return children


def _common(cfg: LaunchConfig, etcd: str) -> list[str]:
    return ["--etcd-endpoints", etcd, "--namespace", cfg.namespace, "--log-level", cfg.log_level,
            "--drain-timeout", str(cfg.drain_timeout_s), *cfg.mesh_argv]


def worker_factory(cfg: LaunchConfig, etcd: str, model: str, console: Console,
                   run_dir: Path) -> Callable[[RoleName], Child]:
    """Makes the planner's workers: a new switchable worker of a role, logging to its own file."""
    env = child_env()
    started = itertools.count(1)

    def make(role: RoleName) -> Child:
        child = planned_worker(cfg, _common(cfg, etcd), model, role, env, run_dir)
        child.console = console
        child.log_path = run_dir / f"{role}-worker-{next(started)}.log"
        return child

    return make


def _engine_argv(cfg: LaunchConfig, common: list[str], model: str) -> list[str]:
    named = ["--served-model-name", cfg.served_model_name] if cfg.served_model_name else []
    return [*common, "--model", model, *named, *cfg.engine_argv]


def _fixed_workers(cfg: LaunchConfig, common: list[str], model: str, env: dict[str, str],
                   run_dir: Path | None) -> list[Child]:
    engine = [*_engine_argv(cfg, common, model), *_encoder_cache(cfg, run_dir)]
    encoding = _encode_transfer(cfg)
    decode = [*engine, *cfg.disagg_argv]
    if cfg.disaggregated:
        decode += ["--kv-transfer", "nixl", "--remote-prefill"]
    elif cfg.encode_workers and cfg.engine == "mocker":
        # Features come over NIXL; the prompt's KV stays here (aggregated).
        decode += ["--kv-transfer", "nixl", "--no-remote-prefill"]
    # Encode workers first: the workers that prefill find them when they join.
    children = _workers("encode-worker", "services.encode_worker", [*engine, *encoding], cfg.encode_workers,
                        cfg.engine, env)
    children += _workers("decode-worker", "services.decode_worker", decode, cfg.decode_workers, cfg.engine, env)
    if cfg.disaggregated:
        children += _workers("prefill-worker", "services.prefill_worker", [*engine, "--kv-transfer", "nixl"],
                             cfg.prefill_workers, cfg.engine, env)
    return children


def _encoder_cache(cfg: LaunchConfig, run_dir: Path | None) -> list[str]:
    """vLLM's image features go through a directory every worker of the run shares
    (vllm_encode.py), where encode workers may run; the mocker's come over NIXL."""
    if not cfg.encode_pool or cfg.engine != "vllm":
        return []
    shared = (run_dir or Path(".cache") / "encoder-cache" / cfg.namespace) / "encoder-cache"
    return ["--encoder-cache-dir", str(shared.resolve())]


def _encode_transfer(cfg: LaunchConfig) -> list[str]:
    """An encode worker's KV transfer: NIXL hands the mocker's features over; vLLM's go through
    the shared directory."""
    return ["--kv-transfer", "none" if cfg.engine == "vllm" else "nixl"]


def planned_worker(cfg: LaunchConfig, common: list[str], model: str, role: RoleName,
                   env: dict[str, str], run_dir: Path | None) -> Child:
    """One worker in its own process that the planner can start and stop (and, but for an encode
    worker, switch): it prefills long prompts remotely while it decodes, and hands KV over NIXL
    while it prefills."""
    engine = [*_engine_argv(cfg, common, model), *_encoder_cache(cfg, run_dir)]
    if role == RoleName.ENCODE:
        argv = [*engine, *_encode_transfer(cfg)]
        return _child("encode-worker", python_module("services.encode_worker", *argv), env, required=True)
    argv = [*engine, *cfg.disagg_argv, "--kv-transfer", "nixl", "--remote-prefill", "--switchable", "--start-as", role]
    return _child(f"{role}-worker", python_module("services.decode_worker", *argv), env, required=True)


def _share_cores(workers: list[Child]) -> None:
    """Each vLLM worker started here binds its engine to its own physical cores (see
    services/engines/cpu_cores.py). A single worker keeps vLLM's own binding, which also leaves a
    core to the engine's scheduler; workers the planner starts later keep it too."""
    if len(workers) < 2:
        return
    for child, share in zip(workers, core_shares(host_cores(), len(workers)), strict=True):
        child.env = {**(child.env or child_env()), **bind_env(share)}


def _connector_argv(cfg: LaunchConfig) -> list[str]:
    if cfg.planner == "local":
        return ["--connector", "local", "--launcher", f"127.0.0.1:{cfg.control_port}"]
    return ["--connector", "none"]


def _child(component: str, argv: list[str], env: dict[str, str], required: bool = False) -> Child:
    return Child(component, argv, env, ready_when=ready_pattern(component), ready_required=required)


def _workers(component: str, module: str, flags: list[str], count: int, engine: str,
             env: dict[str, str]) -> list[Child]:
    # A worker's ready line is printed, whatever the log level: the launcher waits for it.
    if count == 0:
        return []
    if engine == "mocker":
        # Mocker workers are cheap: one process hosts them all, each registered on its own.
        return [_child(component, python_module(module, *flags, "--num-workers", str(count)), env, required=True)]
    return [_child(component, python_module(module, *flags), env, required=True) for _ in range(count)]
