"""Command-line flags every service shares, and the helpers that turn bad input into a one-line exit."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from dataclasses import dataclass
from typing import NoReturn

DEFAULT_ETCD = "http://127.0.0.1:2379"
DEFAULT_NAMESPACE = "kvmesh"


@dataclass(frozen=True)
class MeshConfig:
    """Where the mesh lives: the etcd cluster and the key namespace inside it."""

    etcd_endpoints: tuple[str, ...]
    namespace: str
    log_level: str
    host: str = "127.0.0.1"
    # The address other instances use to reach this one (differs from `host` when binding 0.0.0.0).
    advertise_host: str = "127.0.0.1"


class FlagParser(argparse.ArgumentParser):
    """argparse that reports bad flags as one line (`error: ...`, exit 2) instead of a usage dump."""

    def error(self, message: str) -> NoReturn:
        die(f"{self.prog}: {message} (see --help)")


def add_mesh_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--etcd-endpoints",
        default=os.environ.get("ETCD_ENDPOINTS", DEFAULT_ETCD),
        help="comma-separated etcd client URLs (env ETCD_ENDPOINTS)",
    )
    parser.add_argument(
        "--namespace",
        default=os.environ.get("KVMESH_NAMESPACE", DEFAULT_NAMESPACE),
        help="etcd key namespace of this mesh (env KVMESH_NAMESPACE)",
    )
    parser.add_argument(
        "--log-level",
        default=os.environ.get("KVMESH_LOG_LEVEL", "INFO"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--advertise-host", default=None,
                        help="address registered in etcd for others to reach this instance (default: --host, "
                             "or this machine's address when --host is a wildcard)")


def mesh_config(args: argparse.Namespace) -> MeshConfig:
    endpoints = tuple(e.strip() for e in args.etcd_endpoints.split(",") if e.strip())
    if not endpoints:
        die("--etcd-endpoints is empty")
    for e in endpoints:
        if not e.startswith(("http://", "https://")) or ":" not in e.split("://", 1)[1]:
            die(f"--etcd-endpoints: {e!r} is not a URL like http://127.0.0.1:2379")
    if not args.namespace or "/" in args.namespace:
        die(f"--namespace: {args.namespace!r} must be non-empty and contain no '/'")
    return MeshConfig(endpoints, args.namespace, args.log_level, args.host, args.advertise_host or _advertised(args.host))


def _advertised(host: str) -> str:
    if host not in ("0.0.0.0", "::", ""):
        return host
    return socket.gethostbyname(socket.gethostname())


def setup_logging(level: str, component: str) -> None:
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)s {component} %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # Third-party chatter at INFO drowns the one-line-per-event logs of our own services.
    for noisy in ("httpx", "uvicorn.access", "aetcd", "hpack"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def die(reason: str, code: int = 2) -> NoReturn:
    """Exit with a single-line reason, the contract's behaviour for bad flags."""
    print(f"error: {reason}", file=sys.stderr, flush=True)
    raise SystemExit(code)


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


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value
