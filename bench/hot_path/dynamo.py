"""NVIDIA Dynamo 1.6.1 as the baseline of the hot-path benchmark: installed into its own virtual
environment on first use, started as its frontend (KV router) and its mocker against an etcd of
its own, on this machine, in the same run as kvmesh.

Dynamo is not a dependency of kvmesh: where it cannot be installed (no package index, another
CPU architecture) the benchmark says so and reports kvmesh alone.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from services.mesh.etcd_member import EtcdMember
from services.mesh.net import free_port

ROOT = Path(__file__).resolve().parents[2]
VERSION = "1.6.1"
VENV = ROOT / ".cache" / "bench" / f"dynamo-{VERSION}"
# Its runtime and the Python packages its frontend and mocker import (torch: the CPU build the
# project already uses, so no CUDA wheels are downloaded).
RUNTIME_PACKAGES = [f"ai-dynamo-runtime=={VERSION}", "torch==2.13.0", "aiohttp", "msgspec", "prometheus-client",
                    "pyzmq", "transformers", "tqdm", "zstandard", "kubernetes>=32.0.1,<33", "redis>=6.2,<9"]
INSTALL_TIMEOUT_S = 900
READY_TIMEOUT_S = 120


class Unavailable(RuntimeError):
    """Dynamo cannot run here; the message says why."""


def python() -> Path:
    """The baseline venv's interpreter, installing it on first use (a few minutes, printed)."""
    interpreter = VENV / "bin" / "python"
    stamp = VENV / ".installed"
    if stamp.exists():
        return interpreter
    print(f"dynamo baseline: installing ai-dynamo {VERSION} into {VENV} (first run only) ...", flush=True)
    shutil.rmtree(VENV, ignore_errors=True)
    VENV.parent.mkdir(parents=True, exist_ok=True)
    steps = [[sys.executable, "-m", "venv", str(VENV)],
             [str(interpreter), "-m", "pip", "install", "-q", *RUNTIME_PACKAGES],
             [str(interpreter), "-m", "pip", "install", "-q", "--no-deps", f"ai-dynamo=={VERSION}"]]
    for step in steps:
        try:
            done = subprocess.run(step, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise Unavailable(f"installing Dynamo took over {INSTALL_TIMEOUT_S}s") from exc
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise Unavailable(f"cannot install Dynamo {VERSION}: " + " / ".join(tail))
    stamp.touch()
    return interpreter


@contextmanager
def served(model_dir: Path, model_name: str, *, workers: int = 1, speedup: float = 100000.0,
           num_gpu_blocks: int = 16384) -> Iterator[str]:
    """Dynamo's frontend (KV router) and mocker; yields the base URL (http://127.0.0.1:PORT)."""
    interpreter = python()
    with ExitStack() as stack:
        etcd_url = stack.enter_context(_etcd())
        env = dict(os.environ, ETCD_ENDPOINTS=etcd_url, PYTHONUNBUFFERED="1")
        port = free_port()
        common = ["--discovery-backend", "etcd", "--request-plane", "tcp", "--event-plane", "zmq"]
        stack.enter_context(_process([str(interpreter), "-m", "dynamo.frontend", "--http-port", str(port),
                                      "--router-mode", "kv", *common], env, "dynamo-frontend"))
        stack.enter_context(_process([str(interpreter), "-m", "dynamo.mocker", "--model-path", str(model_dir),
                                      "--model-name", model_name, "--num-workers", str(workers), "--block-size", "16",
                                      "--num-gpu-blocks-override", str(num_gpu_blocks), "--speedup-ratio",
                                      str(speedup), "--enable-prefix-caching", *common], env, "dynamo-mocker"))
        base = f"http://127.0.0.1:{port}"
        _wait_for_model(base, model_name)
        yield base


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
    data = tempfile.mkdtemp(prefix="kvmesh-bench-dynamo-etcd-")
    member = EtcdMember("d", data, "127.0.0.1", free_port(), free_port(), extra=("--log-level", "error", "--logger", "zap"))
    try:
        try:
            argv = member.argv()
        except FileNotFoundError as exc:
            raise Unavailable("etcd is not installed") from exc
        with _process(argv, None, "etcd"):
            yield member.endpoint
    finally:
        shutil.rmtree(data, ignore_errors=True)


@contextmanager
def _process(argv: list[str], env: dict[str, str] | None, name: str) -> Iterator[subprocess.Popen[bytes]]:
    log = tempfile.TemporaryFile(prefix=f"kvmesh-bench-{name}-")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        time.sleep(0.2)
        if proc.poll() is not None:
            log.seek(0)
            raise Unavailable(f"{name} exited at start: {log.read().decode(errors='replace')[-500:]}")
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        log.close()
