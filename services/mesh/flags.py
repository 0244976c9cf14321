"""Flags every process shares, declared once, and the rule that turns a bad setting into one line.

A setting is validated where its config dataclass is built (`__post_init__` raises
`ConfigError` with a one-line reason naming the flag); the command line turns that into
`error: <reason>` on stderr and exit status 2, which is what scripts and deploy checks rely on.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from services.config_error import ConfigError
from services.mesh.config_error import die, validated
from services.mesh.tls import TlsConfig, tls_config, tls_flag_defaults

DEFAULT_ETCD = "http://127.0.0.1:2379"
DEFAULT_NAMESPACE = "kvmesh"
DEFAULT_LOG_LEVEL = "INFO"
# Seconds a stopping service lets in-flight work finish (SIGTERM drains; then it exits 0).
DEFAULT_DRAIN_TIMEOUT_S = 30.0
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("text", "json")
# What a process's sessions to its peers travel on (services/mesh/session_carrier.py).
SESSION_CARRIERS = ("tcp", "grpc")


@dataclass(frozen=True)
class MeshConfig:
    """Where the mesh lives (the etcd cluster, the key namespace) and how this process shows itself."""

    etcd_endpoints: tuple[str, ...] = (DEFAULT_ETCD,)
    namespace: str = DEFAULT_NAMESPACE
    log_level: str = DEFAULT_LOG_LEVEL
    host: str = "127.0.0.1"
    # The address other instances use to reach this one (differs from `host` when binding 0.0.0.0).
    advertise_host: str = "127.0.0.1"
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    log_format: str = "text"
    # None: plaintext gRPC and http:// etcd only.
    tls: TlsConfig | None = None
    # Server reflection lets anyone list and call the RPCs: a development aid, off by default.
    grpc_reflection: bool = False
    # What this process's sessions to peers travel on (session_carrier.py): "tcp" where the peer
    # offers it (else its gRPC stream), or "grpc" always. Its own sessions are served on both.
    session_carrier: str = "tcp"

    def __post_init__(self) -> None:
        if not self.drain_timeout_s >= 0:
            raise ConfigError(f"--drain-timeout must be >= 0, got {self.drain_timeout_s}")
        if not self.etcd_endpoints:
            raise ConfigError("--etcd-endpoints is empty")
        for e in self.etcd_endpoints:
            if not e.startswith(("http://", "https://")) or ":" not in e.split("://", 1)[1]:
                raise ConfigError(f"--etcd-endpoints: {e!r} is not a URL like http://127.0.0.1:2379")
        if not self.namespace or "/" in self.namespace:
            raise ConfigError(f"--namespace: {self.namespace!r} must be non-empty and contain no '/'")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"--log-level: {self.log_level!r} is not one of {', '.join(LOG_LEVELS)}")
        if self.session_carrier not in SESSION_CARRIERS:
            raise ConfigError(f"--session-carrier: {self.session_carrier!r} is not one of {', '.join(SESSION_CARRIERS)}")
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"--log-format: {self.log_format!r} is not one of {', '.join(LOG_FORMATS)}")
        https = [e for e in self.etcd_endpoints if e.startswith("https://")]
        if https and len(https) != len(self.etcd_endpoints):
            # Failing over from an https member to an http one would downgrade to plaintext.
            raise ConfigError("--etcd-endpoints mixes https:// and http://: use one scheme for every member")
        if https and self.tls is None:
            raise ConfigError(f"--etcd-endpoints {https[0]} is https: it needs --tls-cert, --tls-key and --tls-ca")


@dataclass(frozen=True)
class ModelRef:
    """The model a process serves: its Hugging Face directory and the name clients ask for."""

    model_dir: str
    served_model_name: str

    def __post_init__(self) -> None:
        if not (Path(self.model_dir) / "config.json").is_file():
            raise ConfigError(f"--model {self.model_dir}: no config.json there (expected a Hugging Face model directory)")
        if not self.served_model_name:
            raise ConfigError("--served-model-name is empty")


class FlagParser(argparse.ArgumentParser):
    """argparse that reports bad flags as one line (`error: ...`, exit 2) instead of a usage dump."""

    def error(self, message: str) -> NoReturn:
        die(f"{self.prog}: {message} (see --help)")


def add_mesh_flags(parser: argparse.ArgumentParser, *, embedded_etcd: bool = False) -> None:
    """--etcd-endpoints, --namespace, --log-level, and for services --host/--advertise-host.

    With `embedded_etcd` (the launcher) --etcd-endpoints defaults to none, meaning "start an
    etcd of your own", and the bind flags apply to every process it starts."""
    if embedded_etcd:
        parser.add_argument("--etcd-endpoints", default=None,
                            help="join this etcd (comma-separated URLs) instead of starting one")
    else:
        parser.add_argument("--etcd-endpoints", default=os.environ.get("ETCD_ENDPOINTS") or DEFAULT_ETCD,
                            help="comma-separated etcd client URLs (env ETCD_ENDPOINTS)")
    parser.add_argument("--namespace", default=os.environ.get("KVMESH_NAMESPACE", DEFAULT_NAMESPACE),
                        help="etcd key namespace of this mesh (env KVMESH_NAMESPACE)")
    parser.add_argument("--log-level", default=os.environ.get("KVMESH_LOG_LEVEL", DEFAULT_LOG_LEVEL),
                        choices=LOG_LEVELS, type=str.upper)
    parser.add_argument("--log-format", default=os.environ.get("KVMESH_LOG_FORMAT", "text"), choices=LOG_FORMATS,
                        help="text, or json: one JSON object per line (env KVMESH_LOG_FORMAT)")
    parser.add_argument("--drain-timeout", type=non_negative_float, default=DEFAULT_DRAIN_TIMEOUT_S,
                        help="seconds in-flight work may take to finish after SIGTERM")
    parser.add_argument("--check-config", action="store_true",
                        help="validate every flag and exit: 0, or 2 with a one-line error; starts nothing")
    tls = tls_flag_defaults()
    parser.add_argument("--tls-cert", default=tls["cert"], help="PEM certificate of this process (env KVMESH_TLS_CERT)")
    parser.add_argument("--tls-key", default=tls["key"], help="its PEM private key (env KVMESH_TLS_KEY)")
    parser.add_argument("--tls-ca", default=tls["ca"],
                        help="PEM CA that signs every mesh certificate; with the two above, internal gRPC is "
                             "mutual TLS and https:// etcd is used with the same files (env KVMESH_TLS_CA)")
    parser.add_argument("--tls-server-name", default=tls["server_name"],
                        help="check every mesh peer's certificate against this name instead of the address it "
                             "registered, so one certificate can serve the whole mesh (env KVMESH_TLS_SERVER_NAME)")
    parser.add_argument("--grpc-reflection", action="store_true",
                        help="serve gRPC server reflection (development; off by default)")
    parser.add_argument("--session-carrier", choices=SESSION_CARRIERS,
                        default=os.environ.get("KVMESH_SESSION_CARRIER", "tcp"),
                        help="tcp: this process's sessions to peers (requests to processors, routers and workers) "
                             "travel as frames on a TCP connection of their own where the peer offers one, else on "
                             "its gRPC stream; grpc: always on the gRPC stream (env KVMESH_SESSION_CARRIER)")
    what = "every process it starts binds (its embedded etcd too)" if embedded_etcd else "to bind"
    parser.add_argument("--host", default="127.0.0.1", help=f"address {what}")
    parser.add_argument("--advertise-host", default=None,
                        help="address registered in etcd for others to reach this instance (default: --host, "
                             "or this machine's address when --host is a wildcard)")


def split_endpoints(text: str) -> tuple[str, ...]:
    return tuple(e.strip() for e in text.split(",") if e.strip())


def mesh_config(args: argparse.Namespace) -> MeshConfig:
    host = getattr(args, "host", "127.0.0.1")
    advertise = getattr(args, "advertise_host", None) or _advertised(host)
    return validated(lambda: MeshConfig(split_endpoints(args.etcd_endpoints), args.namespace, args.log_level,
                                        host, advertise, args.drain_timeout, args.log_format,
                                        tls_config(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name),
                                        args.grpc_reflection, getattr(args, "session_carrier", "tcp")))


def exit_if_checking(args: argparse.Namespace) -> None:
    """Validates the settings read from the environment (OTEL_*), then for `--check-config`,
    every setting having been validated and nothing started, exits 0."""
    from services.mesh.tracing import settings_from_env  # tracing imports this module

    validated(lambda: settings_from_env(os.environ))
    if getattr(args, "check_config", False):
        raise SystemExit(0)


def _advertised(host: str) -> str:
    if host not in ("0.0.0.0", "::", ""):
        return host
    return socket.gethostbyname(socket.gethostname())


def add_model_flags(parser: argparse._ActionsContainer) -> None:
    parser.add_argument("--model", default=None, help="model directory (default: the demo model)")
    parser.add_argument("--served-model-name", default=None, help="default: the model directory's name")


def model_ref(args: argparse.Namespace) -> ModelRef:
    """The model named by --model (the demo model, built on first use, when none is given)."""
    from services.tools.make_demo_model import ensure_demo_model

    model = Path(args.model) if args.model else ensure_demo_model()
    return validated(lambda: ModelRef(str(model.resolve()), args.served_model_name or model.resolve().name))


def forward_flags(args: argparse.Namespace, actions: Iterable[argparse.Action], skip: Iterable[str] = ()) -> list[str]:
    """The command line that gives a child process the same values of these flags.

    The launcher declares the flags of every service it starts with the services' own
    `add_*_flags` functions, then hands the parsed values down with this: a default lives only
    where the flag is declared. Flags left at None are not passed (the child applies its default).
    """
    skipped = set(skip)
    argv: list[str] = []
    for action in actions:
        if action.dest in skipped or not action.option_strings:
            continue
        value = getattr(args, action.dest, None)
        if value is None:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, bool):
            if value:
                argv.append(flag)
        elif isinstance(action, argparse._AppendAction):
            for item in value:  # a repeatable flag: once per value
                argv += [flag, str(item)]
        else:
            argv += [flag, str(value)]
    return argv


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def port_number(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0..65535, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value
