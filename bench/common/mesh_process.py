"""Starting a mesh of kvmesh processes: the one starter of the benchmarks and the tests (bench/
never imports tests/, so it lives here and tests/procs.py builds on it).

Two ways to start one:
- the launcher (`python -m services.launch`), which starts etcd and every service itself, prints
  `CHILD <component> pid=<pid>` for each and `READY <url>` once the mesh serves:
  `LaunchedMesh.start`, or `launched_mesh` around a block;
- service by service against an etcd of the caller's: `service_argv` is each service's command
  line and `READY` what each prints once it serves (tests/procs.py's `ServiceMesh`, the chaos
  run's and the hosts run's meshes).

Every child here is a `Proc`: its output (stdout and stderr together) read line by line on a
thread and kept, so a failure can say what the child said last. A start that fails stops what it
started: no process of ours outlives its caller.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from bench.common.proc_stat import cpu_seconds
from services.mesh.discovery import DECODE_WORKER, FRONTEND, PREFILL_WORKER, PROCESSOR, ROUTER
from services.mesh.net import free_port

ROOT = Path(__file__).resolve().parents[2]

# The module each service runs, and what it prints or logs once it serves, its instance id (or a
# worker process's ids, space-separated) in group 1.
MODULES = {ROUTER: "services.kv_router", PROCESSOR: "services.processor", FRONTEND: "services.frontend",
           PREFILL_WORKER: "services.prefill_worker", DECODE_WORKER: "services.decode_worker"}
READY = {ROUTER: r"router (\w+) \(", PROCESSOR: r"processor (\w+) for", FRONTEND: r"frontend (\w+) listening on",
         PREFILL_WORKER: r"prefill-worker ready: (.+)$", DECODE_WORKER: r"decode-worker ready: (.+)$"}


def service_argv(component: str, etcd_endpoints: str, namespace: str, *flags: str) -> list[str]:
    """The command line of one `component` ("kv-router", ...) joining `namespace` on etcd."""
    return python_module(MODULES[component], "--etcd-endpoints", etcd_endpoints, "--namespace", namespace, *flags)


def python_module(module: str, *args: str) -> list[str]:
    # Not services.launch.children's: importing services.launch sets GRPC_ENABLE_FORK_SUPPORT in
    # this process's environment, which every child here would inherit.
    return [sys.executable, "-m", module, *args]


class Proc:
    """A child run in the repository root, its merged output collected line by line on a thread."""

    def __init__(self, argv: Sequence[str], name: str, env: dict[str, str] | None = None) -> None:
        self.name = name
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.popen = subprocess.Popen(
            list(argv), cwd=ROOT, env=full_env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
        )
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match[str]:
        """The first output line matching `pattern`; fails with the output tail if the child dies."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    if m := regex.search(line):
                        return m
                seen = len(self.lines)
                if self.popen.poll() is not None and not self._reader.is_alive():
                    raise RuntimeError(f"{self.name} exited ({self.popen.returncode}) before {pattern!r}:\n{self.tail()}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{self.name}: no {pattern!r} within {timeout_s}s:\n{self.tail()}")
                self._cond.wait(min(remaining, 0.5))

    def tail(self, n: int = 60) -> str:
        with self._cond:
            return "\n".join(self.lines[-n:])

    def terminate(self) -> None:
        """SIGTERM (the service drains); `stop` then waits for it."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 20) -> int:
        """SIGTERM, SIGKILL after `timeout_s`; the exit status."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self._reader.join(5)
        return self.popen.returncode

    def kill(self) -> None:
        self.popen.kill()
        self.popen.wait(10)


@dataclass
class LaunchedMesh:
    """A mesh `services.launch` started, from its READY line on; its output in `launcher.lines`."""

    launcher: Proc
    base_url: str  # what READY names: http://HOST:PORT/v1 (HOST is the launcher's --host)
    # (component, pid) of every child the launcher started before READY, etcd included.
    children: list[tuple[str, int]]
    # The launcher's exit status once `stop` stopped it (negative: killed by that signal).
    exit_code: int | None = None

    @classmethod
    def start(cls, *flags: str, timeout_s: float = 180, prefix: Sequence[str] = (),
              log_level: str | None = "WARNING", name: str = "launch") -> Self:
        """Starts the launcher on a free HTTP port without prefill workers (`flags` come after,
        so they may say otherwise) and returns once it says READY; stops it and raises when it
        exits or stays silent first. `prefix`: what to run it under (`ip netns exec ...`);
        `log_level` None keeps the launcher's own."""
        quiet = ("--log-level", log_level) if log_level else ()
        launcher = Proc([*prefix, *python_module("services.launch", "--http-port", str(free_port()),
                                                 "--prefill-workers", "0", *quiet, *flags)], name)
        try:
            base_url = launcher.wait_for(r"^READY (\S+)", timeout_s).group(1)
        except BaseException:
            launcher.stop(30)
            raise
        return cls(launcher, base_url, _children(launcher.lines))

    @property
    def base(self) -> str:
        """http://HOST:PORT, without the /v1 of the API."""
        return self.base_url.removesuffix("/v1")

    def stop(self, timeout_s: float = 30) -> int:
        """SIGTERM (the launcher stops its children in order), SIGKILL after `timeout_s`."""
        self.exit_code = self.launcher.stop(timeout_s)
        return self.exit_code

    def pids(self, component: str) -> list[int]:
        return [pid for name, pid in self.children if name == component]

    def cpu_by_component(self) -> dict[str, float]:
        """CPU seconds so far of each component's processes (replicas summed), etcd left out."""
        out: dict[str, float] = {}
        for name, pid in self.children:
            if name != "etcd":
                out[name] = out.get(name, 0.0) + cpu_seconds(pid)
        return out

    def cpu(self) -> float:
        """CPU seconds so far of all the mesh's processes, etcd left out."""
        return sum(self.cpu_by_component().values())


def _children(lines: list[str]) -> list[tuple[str, int]]:
    out = []
    for line in lines:
        if line.startswith("READY"):
            break
        if m := re.match(r"CHILD (\S+) pid=(\d+)", line):
            out.append((m.group(1), int(m.group(2))))
    return out


@contextmanager
def launched_mesh(*flags: str, timeout_s: float = 180, prefix: Sequence[str] = ()) -> Iterator[LaunchedMesh]:
    """`LaunchedMesh.start` for the block; stopped after it."""
    mesh = LaunchedMesh.start(*flags, timeout_s=timeout_s, prefix=prefix)
    try:
        yield mesh
    finally:
        mesh.stop()


@contextmanager
def launched(*flags: str, timeout_s: float = 180) -> Iterator[str]:
    """Yields the mesh's base URL (http://127.0.0.1:PORT) once it is READY; stops it afterwards."""
    with launched_mesh(*flags, timeout_s=timeout_s) as mesh:
        yield mesh.base
