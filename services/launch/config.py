"""The launcher's settings: the services' own flags, optionally defaulted from a YAML file.

The launcher declares no service flag itself: it adds each service's flag group with that
service's `add_*_flags` and forwards the parsed values to the child, so every default lives in
exactly one place. A YAML file in the shape of a Dynamo-style worker config sets defaults; flags win:

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

Keys may also sit under a `VllmWorker:` / `Worker:` / `ServiceArgs:` section, as in such files.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from services.decode_worker.flags import add_disagg_flags
from services.frontend.flags import add_frontend_flags
from services.routing.flags import add_router_flags
from services.config_error import ConfigError
from services.mesh.config_error import validated
from services.mesh.flags import (
    DEFAULT_ETCD,
    FlagParser,
    MeshConfig,
    add_mesh_flags,
    die,
    forward_flags,
    mesh_config,
    non_negative_int,
    positive_float,
    positive_int,
)
from services.mesh.net import free_port
from services.mesh.tls import TlsConfig
from services.planner.flags import add_planner_flags, encode_pool_max
from services.processor.flags import add_processor_flags
from services.worker.engine_flags import add_engine_flags

_SECTIONS = ("VllmWorker", "Worker", "PrefillWorker", "Router", "Processor", "Frontend", "ServiceArgs")
_ALIASES = {"router": "router_mode", "workers": "decode_workers"}
_IGNORED = {"enable_prefix_caching", "tensor_parallel_size", "resources"}
ON_CHILD_EXIT = ("restart", "exit")
PLANNER_MODES = ("off", "none", "local")


@dataclass(frozen=True)
class LaunchConfig:
    engine: str
    model: str | None
    served_model_name: str | None
    decode_workers: int
    prefill_workers: int
    # Replicas of the stateless services: the frontend spreads requests over the processors,
    # which use any live router.
    processors: int
    # Frontends sharing --http-port (SO_REUSEPORT).
    frontends: int
    routers: int
    # Prefill workers get work (decode workers prefill long prompts on them).
    remote_prefill: bool
    http_port: int
    api_key: str | None = field(repr=False)
    # None: start an embedded etcd.
    etcd_endpoints: str | None
    namespace: str
    log_level: str
    drain_timeout_s: float
    ready_timeout_s: float
    # "restart" a child that exits after start-up, or "exit": stop the mesh.
    on_child_exit: str
    # Where the frontend answers /health: --metrics-port when given, else --http-port.
    health_port: int
    # Every child's full output goes to a file in this directory (None: a new one under
    # .cache/runs/); the console shows only what matters unless `verbose`.
    run_dir: Path | None
    verbose: bool
    # --check-config: validate everything, every child's command line included; start nothing.
    check_config: bool
    # Given to every child: --host and --advertise-host, --log-format, the TLS files, --grpc-reflection.
    mesh_argv: tuple[str, ...]
    # Each service's flags as given to the launcher, forwarded to its children.
    engine_argv: tuple[str, ...]
    disagg_argv: tuple[str, ...]
    router_argv: tuple[str, ...]
    processor_argv: tuple[str, ...]
    frontend_argv: tuple[str, ...]
    # off: no planner; none: a planner that plans and exports only; local: one that starts, stops
    # and switches this launcher's workers (each then a switchable worker in its own process).
    planner: str = "off"
    planner_argv: tuple[str, ...] = ()
    # Where the launcher serves LauncherControl for a local planner (loopback).
    control_port: int = 0
    # The mesh's TLS, for the launcher's own control server.
    tls: TlsConfig | None = None
    # --demo-lora (`make run` passes it): with the demo model and no --lora-modules, the workers
    # serve the demo LoRA adapters (see `with_demo_adapters`).
    demo_lora: bool = False
    # Each frontend hosts its processor (--embed-processor): no processor processes.
    embed_processors: bool = False
    # Where the mesh is reached: what the children register and the READY line names, and where
    # the embedded etcd listens (--advertise-host, else --host; loopback by default).
    advertise_host: str = "127.0.0.1"
    # Encode workers (E/P/D): the workers that prefill have their images encoded there.
    encode_workers: int = 0
    # The planner's --max-encode-workers: the most a local planner starts (0: it leaves the encode
    # pool alone).
    max_encode_workers: int = 0

    def __post_init__(self) -> None:
        if self.decode_workers < 1 or self.prefill_workers < 0:
            raise ConfigError("--decode-workers must be >= 1 and --prefill-workers >= 0")
        if self.processors < 1 or self.routers < 1 or self.frontends < 1:
            raise ConfigError("--processors, --routers and --frontends must be >= 1")
        if self.embed_processors and self.processors != 1:
            raise ConfigError("--processors with --embed-processors: each frontend hosts one processor, so "
                              "--frontends sets how many there are")
        if not self.drain_timeout_s >= 0:
            raise ConfigError(f"--drain-timeout must be >= 0, got {self.drain_timeout_s}")
        if not self.ready_timeout_s > 0:
            raise ConfigError(f"--ready-timeout must be > 0, got {self.ready_timeout_s}")
        if self.encode_workers < 0:
            raise ConfigError(f"--encode-workers must be >= 0, got {self.encode_workers}")

    @property
    def disaggregated(self) -> bool:
        return self.prefill_workers > 0 and self.remote_prefill

    @property
    def planner_switches(self) -> bool:
        """The planner starts, stops and switches the workers (each its own switchable process)."""
        return self.planner == "local"

    @property
    def encode_pool(self) -> bool:
        """Encode workers may run: started with the mesh, or by a planner that sizes their pool."""
        return self.encode_workers > 0 or (self.planner_switches and self.max_encode_workers > 0)


@dataclass(frozen=True)
class _Groups:
    engine: argparse._ArgumentGroup
    disagg: argparse._ArgumentGroup
    router: argparse._ArgumentGroup
    processor: argparse._ArgumentGroup
    frontend: argparse._ArgumentGroup
    planner: argparse._ArgumentGroup


def parser() -> tuple[FlagParser, _Groups]:
    p = FlagParser(prog="python -m services.launch", description="Start a whole local kvmesh.")
    p.add_argument("--config", type=Path, help="YAML file with defaults for these flags")
    add_mesh_flags(p, embedded_etcd=True)
    p.add_argument("--decode-workers", type=positive_int, default=1)
    p.add_argument("--prefill-workers", type=non_negative_int, default=1, help="0 = aggregated serving")
    p.add_argument("--encode-workers", type=non_negative_int, default=0,
                   help="encode workers (E/P/D): the workers that prefill a prompt with images have them encoded "
                        "there (the mocker's features come over NIXL, vLLM's through a directory of the run's; "
                        "0 = encode in place; with --planner local, the pool's size at start, which the planner "
                        "then sizes up to --max-encode-workers, default 4)")
    p.add_argument("--processors", type=positive_int, default=1, help="processor replicas")
    p.add_argument("--embed-processors", action="store_true",
                   help="each frontend hosts its processor in its own process and calls it in-process (one hop "
                        "and one process fewer per request; the processor flags apply to them); no processor "
                        "processes are started")
    p.add_argument("--frontends", type=positive_int, default=1, help="frontend replicas, sharing --http-port")
    p.add_argument("--routers", type=positive_int, default=1, help="kv-router replicas")
    p.add_argument("--ready-timeout", type=positive_float, default=600.0, help="seconds to wait for /health")
    p.add_argument("--on-child-exit", choices=ON_CHILD_EXIT, default="restart",
                   help="a service that exits after start-up is restarted (with back-off) or stops the mesh")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="write each process's output to DIR/<component>.log (default: a new .cache/runs/<time>-<pid>/)")
    p.add_argument("--verbose", action="store_true",
                   help="show every line of every process on the console, not only warnings and errors")
    p.add_argument("--demo-lora", action="store_true",
                   help="with the demo model (no --model) and no --lora-modules, serve the demo LoRA adapters "
                        "demo-lora-a and demo-lora-b (made beside the demo model on first use); `make run` sets it")
    p.add_argument("--planner", choices=PLANNER_MODES, default="off",
                   help="none: a planner that plans and exports its plan only; local: one that also starts, stops "
                        "and switches the workers")
    groups = _Groups(engine=add_engine_flags(p), disagg=add_disagg_flags(p), router=add_router_flags(p),
                     processor=add_processor_flags(p), frontend=add_frontend_flags(p), planner=add_planner_flags(p))
    return p, groups


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
    p, groups = parser()
    args = p.parse_args(argv)
    if args.config is not None:
        p.set_defaults(**_yaml_defaults(args.config, p))
        args = p.parse_args(argv)

    # The launcher's etcd is checked by the same rules a service's is (and its TLS files read),
    # with an embedded etcd standing in when none is given.
    mesh = mesh_config(argparse.Namespace(**{**vars(args), "etcd_endpoints": args.etcd_endpoints or DEFAULT_ETCD}))
    # Port 0 would let the frontend pick a port the launcher could not poll or print: pick it here.
    for port_flag in ("http_port", "metrics_port"):
        if getattr(args, port_flag, None) == 0:
            setattr(args, port_flag, free_port())

    def forwarded(group: argparse._ArgumentGroup, skip: tuple[str, ...] = ()) -> tuple[str, ...]:
        return tuple(forward_flags(args, group._group_actions, skip))

    if args.frontends > 1 and args.metrics_port:
        die("--metrics-port with --frontends > 1: each frontend would need a port of its own; leave it out "
            "(metrics are then on --http-port)")
    # A local planner's encode pool limits, checked here rather than in its child.
    max_encode = validated(lambda: encode_pool_max(args.min_encode_workers if args.planner == "local" else 0,
                                                   _max_encode_workers(args)))
    return validated(lambda: LaunchConfig(
        engine=args.engine, model=args.model, served_model_name=args.served_model_name,
        decode_workers=args.decode_workers,
        prefill_workers=args.prefill_workers, processors=args.processors, frontends=args.frontends,
        encode_workers=args.encode_workers,
        max_encode_workers=max_encode,
        routers=args.routers,
        remote_prefill=args.remote_prefill is not False,
        http_port=args.http_port, api_key=args.api_key, etcd_endpoints=args.etcd_endpoints,
        namespace=args.namespace, log_level=args.log_level,
        drain_timeout_s=args.drain_timeout, ready_timeout_s=args.ready_timeout,
        on_child_exit=args.on_child_exit,
        health_port=getattr(args, "metrics_port", None) or args.http_port,
        run_dir=args.run_dir, verbose=args.verbose, check_config=args.check_config,
        mesh_argv=_mesh_argv(mesh),
        # The launcher resolves the model once (building the demo model if needed) and passes it.
        # --lora-modules takes a list, which forward_flags cannot write: it goes as one flag and its entries.
        engine_argv=(*forwarded(groups.engine, ("model", "served_model_name", "lora_modules")),
                     *_lora_modules_argv(args.lora_modules)),
        # Whether prefill goes remote is the launcher's call (it knows the prefill pool's size).
        disagg_argv=forwarded(groups.disagg, ("remote_prefill",)),
        router_argv=forwarded(groups.router),
        processor_argv=forwarded(groups.processor),
        # The API key goes by environment so it never shows in `ps`.
        frontend_argv=forwarded(groups.frontend, ("api_key",)),
        planner=args.planner,
        planner_argv=_planner_argv(args, forwarded(groups.planner, skip=("max_encode_workers",)), max_encode),
        control_port=free_port() if args.planner == "local" else 0,
        tls=mesh.tls,
        advertise_host=mesh.advertise_host,
        demo_lora=args.demo_lora,
        embed_processors=args.embed_processors,
    ))


def _lora_modules_argv(modules: list[str] | str | None) -> list[str]:
    """`--lora-modules NAME=PATH ...` for the workers (a YAML file may give one entry as a string)."""
    entries = [modules] if isinstance(modules, str) else list(modules or [])
    return ["--lora-modules", *entries] if entries else []


def with_demo_adapters(cfg: LaunchConfig) -> LaunchConfig:
    """The rule of --demo-lora: the launcher serving the demo model (no --model) with no
    --lora-modules gives every worker `--lora-modules demo-lora-a=PATH demo-lora-b=PATH`, creating
    the adapters beside the demo model if needed; otherwise `cfg` as it is (the demo adapters fit
    the demo model only, and adapters the user names replace them)."""
    if not cfg.demo_lora or cfg.model or "--lora-modules" in cfg.engine_argv:
        return cfg
    from services.tools.make_demo_adapter import ensure_demo_adapters

    return replace(cfg, engine_argv=(*cfg.engine_argv, *_lora_modules_argv(ensure_demo_adapters())))


# A local planner given encode workers sizes their pool up to this many, unless told otherwise.
DEFAULT_MAX_ENCODE_WORKERS = 4


def _max_encode_workers(args: argparse.Namespace) -> int:
    """The planner's --max-encode-workers: as given, but a local planner given encode workers
    sizes their pool (up to DEFAULT_MAX_ENCODE_WORKERS, or more if it starts with more)."""
    if args.planner != "local" or args.max_encode_workers:
        return int(args.max_encode_workers)
    return max(DEFAULT_MAX_ENCODE_WORKERS, args.encode_workers) if args.encode_workers else 0


def _planner_argv(args: argparse.Namespace, given: tuple[str, ...], max_encode: int) -> tuple[str, ...]:
    """The planner's flags; with the mocker its profile is the mocker's own timing unless given
    (a profile given was measured as it is: the mocker's speedup is not applied to it). A local
    planner given encode workers sizes their pool."""
    argv = list(given)
    if max_encode:
        argv += ["--max-encode-workers", str(max_encode)]
    if args.engine == "mocker" and args.profile is None:
        argv += ["--profile", args.timing_profile or args.timing]
        if args.profile_speedup is None:
            argv += ["--profile-speedup", str(args.speedup)]
    return tuple(argv)


def _mesh_argv(mesh: MeshConfig) -> tuple[str, ...]:
    """What every child gets besides its etcd, namespace, log level and drain timeout: where it
    binds and what it registers, the log format, TLS.

    `make run` is for development: gRPC server reflection is on, so `grpcurl` can list and call
    every service."""
    argv = ["--log-format", mesh.log_format, "--grpc-reflection", "--host", mesh.host,
            "--advertise-host", mesh.advertise_host, "--session-carrier", mesh.session_carrier]
    if mesh.tls is not None:
        # Absolute, so a child's check or a restart does not depend on its working directory.
        argv += ["--tls-cert", str(Path(mesh.tls.cert_file).resolve()), "--tls-key", str(Path(mesh.tls.key_file).resolve()),
                 "--tls-ca", str(Path(mesh.tls.ca_file).resolve())]
        if mesh.tls.server_name:
            argv += ["--tls-server-name", mesh.tls.server_name]
    return tuple(argv)
