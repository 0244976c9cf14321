"""The launcher's settings: flags, optionally defaulted from a YAML file in the seed's shape.

    engine: mocker
    model: .cache/models/kvmesh-demo
    block-size: 16
    router: kv                     # or router-mode
    remote-prefill: true
    conditional-disagg: true
    max-local-prefill-length: 512
    max-prefill-queue-size: 2
    decode-workers: 2
    prefill-workers: 1

Keys may also sit under a `VllmWorker:` / `Worker:` section as in the seed; flags win over the file.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from services.common.config import FlagParser, die, non_negative_int, positive_float, positive_int
from services.engines.factory import ENGINES
from services.engines.mocker.timing import PRESETS
from services.kv_router.service import ROUTER_MODES

_SECTIONS = ("VllmWorker", "Worker", "PrefillWorker", "Router", "Processor", "Frontend", "ServiceArgs")
_ALIASES = {"router": "router_mode", "workers": "decode_workers"}
_IGNORED = {"enable_prefix_caching", "tensor_parallel_size", "resources"}


@dataclass(frozen=True)
class LaunchConfig:
    engine: str
    model: str | None
    served_model_name: str | None
    decode_workers: int
    prefill_workers: int
    router_mode: str
    http_port: int
    block_size: int | None
    max_local_prefill_length: int
    max_prefill_queue_size: int
    remote_prefill: bool
    conditional_disagg: bool
    etcd_endpoints: str | None
    namespace: str
    api_key: str | None
    num_gpu_blocks: int
    speedup: float
    timing: str
    log_level: str
    ready_timeout_s: float


def parser() -> argparse.ArgumentParser:
    p = FlagParser(prog="python -m services.launch", description="Start a whole local kvmesh.")
    p.add_argument("--config", type=Path, help="YAML file with defaults for these flags")
    p.add_argument("--engine", choices=ENGINES, default="vllm")
    p.add_argument("--model", default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--decode-workers", type=positive_int, default=1)
    p.add_argument("--prefill-workers", type=non_negative_int, default=1, help="0 = aggregated serving")
    p.add_argument("--router-mode", choices=ROUTER_MODES, default="kv")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--block-size", type=positive_int, default=None)
    p.add_argument("--max-local-prefill-length", type=non_negative_int, default=512)
    p.add_argument("--max-prefill-queue-size", type=non_negative_int, default=2)
    p.add_argument("--remote-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--conditional-disagg", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--etcd-endpoints", default=None, help="use this etcd instead of starting one")
    p.add_argument("--namespace", default=os.environ.get("KVMESH_NAMESPACE", "kvmesh"))
    p.add_argument("--api-key", default=os.environ.get("KVMESH_API_KEY") or None)
    p.add_argument("--num-gpu-blocks", type=positive_int, default=16384)
    p.add_argument("--speedup", type=positive_float, default=1.0)
    p.add_argument("--timing", choices=sorted(PRESETS), default="h100-8b", help="mocker: timing model preset")
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--ready-timeout", type=positive_float, default=600.0, help="seconds to wait for /health")
    return p


def _yaml_defaults(path: Path, p: argparse.ArgumentParser) -> dict[str, object]:
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        die(f"--config {path}: {exc}")
    if not isinstance(raw, dict):
        die(f"--config {path}: expected a mapping of settings")
    flat: dict[str, object] = {}
    for key, value in raw.items():
        if key in _SECTIONS and isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    known = {a.dest for a in p._actions}
    out: dict[str, object] = {}
    for key, value in flat.items():
        dest = _ALIASES.get(key.replace("-", "_"), key.replace("-", "_"))
        if dest in _IGNORED:
            continue
        if dest not in known or dest == "config":
            die(f"--config {path}: unknown setting {key!r}")
        out[dest] = value
    return out


def load(argv: list[str] | None = None) -> LaunchConfig:
    p = parser()
    args = p.parse_args(argv)
    if args.config is not None:
        p.set_defaults(**_yaml_defaults(args.config, p))
        args = p.parse_args(argv)
    if args.router_mode not in ROUTER_MODES:
        die(f"router mode {args.router_mode!r} is not one of {', '.join(ROUTER_MODES)}")
    return LaunchConfig(
        engine=args.engine, model=args.model, served_model_name=args.served_model_name,
        decode_workers=args.decode_workers, prefill_workers=args.prefill_workers, router_mode=args.router_mode,
        http_port=args.http_port, block_size=args.block_size, max_local_prefill_length=args.max_local_prefill_length,
        max_prefill_queue_size=args.max_prefill_queue_size, remote_prefill=args.remote_prefill,
        conditional_disagg=args.conditional_disagg, etcd_endpoints=args.etcd_endpoints, namespace=args.namespace,
        api_key=args.api_key, num_gpu_blocks=args.num_gpu_blocks, speedup=args.speedup, timing=args.timing,
        log_level=args.log_level,
        ready_timeout_s=args.ready_timeout,
    )
