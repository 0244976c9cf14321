"""NVIDIA Dynamo 1.6.1 as the baseline of the hot-path benchmark: installed into its own virtual
environment on first use, started as its frontend (KV router) and its mocker against an etcd of
its own, on this machine, in the same run as kvmesh.

Dynamo is not a dependency of kvmesh: where it cannot be installed (no package index, another
CPU architecture) the benchmark says so and reports kvmesh alone.
"""

from __future__ import annotations

import os
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common.side_venv import Unavailable, side_venv, started
from services.mesh.net import free_port
from testkit.etcd import Etcd
from testkit.proc import ProcFailed

VERSION = "1.6.1"
# Its runtime and the Python packages its frontend and mocker import (torch: the CPU build the
# project already uses, so no CUDA wheels are downloaded).
RUNTIME_PACKAGES = [f"ai-dynamo-runtime=={VERSION}", "torch==2.13.0", "aiohttp", "msgspec", "prometheus-client",
                    "pyzmq", "transformers", "tqdm", "zstandard", "kubernetes>=32.0.1,<33", "redis>=6.2,<9"]
READY_TIMEOUT_S = 120


def python() -> Path:
    """The baseline venv's interpreter, installing it on first use (a few minutes, printed)."""
    return side_venv(f"dynamo-{VERSION}", [RUNTIME_PACKAGES, ["--no-deps", f"ai-dynamo=={VERSION}"]],
                     f"the Dynamo {VERSION} baseline")


@dataclass(frozen=True)
class Served:
    base: str  # http://127.0.0.1:PORT
    # The pids of its processes by role ("frontend", "mocker"): their CPU is measured.
    pids: dict[str, list[int]]


@contextmanager
def serving(model_dir: Path, model_name: str, *, workers: int = 1, speedup: float = 100000.0,
            num_gpu_blocks: int = 16384, frontend_flags: Sequence[str] = (),
            mocker_flags: Sequence[str] = ()) -> Iterator[Served]:
    """Dynamo's frontend (KV router) and mocker, once its frontend lists the model."""
    interpreter = python()
    with ExitStack() as stack:
        etcd_url = stack.enter_context(_etcd())
        env = dict(os.environ, ETCD_ENDPOINTS=etcd_url, PYTHONUNBUFFERED="1")
        port = free_port()
        common = ["--discovery-backend", "etcd", "--request-plane", "tcp", "--event-plane", "zmq"]
        frontend = stack.enter_context(started([str(interpreter), "-m", "dynamo.frontend", "--http-port", str(port),
                                                "--router-mode", "kv", *common, *frontend_flags], env,
                                               "dynamo-frontend"))
        mocker = stack.enter_context(started([str(interpreter), "-m", "dynamo.mocker", "--model-path", str(model_dir),
                                              "--model-name", model_name, "--num-workers", str(workers),
                                              "--block-size", "16", "--num-gpu-blocks-override", str(num_gpu_blocks),
                                              "--speedup-ratio", str(speedup), "--enable-prefix-caching", *common,
                                              *mocker_flags], env, "dynamo-mocker"))
        base = f"http://127.0.0.1:{port}"
        _wait_for_model(base, model_name)
        yield Served(base, {"frontend": [frontend.pid], "mocker": [mocker.pid]})


@contextmanager
def served(model_dir: Path, model_name: str, **options: Any) -> Iterator[str]:
    """`serving`, yielding its base URL."""
    with serving(model_dir, model_name, **options) as s:
        yield s.base


def _wait_for_model(base: str, model_name: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=2) as reply:
                if model_name.encode() in reply.read():
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise Unavailable(f"Dynamo's frontend did not list {model_name} within {READY_TIMEOUT_S}s")


@contextmanager
def _etcd() -> Iterator[str]:
    try:
        etcd = Etcd.start(extra=("--log-level", "error", "--logger", "zap"))
    except ProcFailed as exc:
        raise Unavailable(f"etcd: {str(exc).splitlines()[0]}") from exc
    try:
        yield etcd.endpoint
    finally:
        etcd.stop()
