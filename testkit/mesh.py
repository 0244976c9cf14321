"""Starting a mesh of kvmesh processes, and asking etcd what joined it: the mesh starters of the
tests and the benchmarks.

Two ways to start one:
- the launcher (`python -m services.launch`), which starts etcd and every service itself, prints
  `CHILD <component> pid=<pid>` for each and `READY <url>` once the mesh serves:
  `LaunchedMesh.start`, or `launched_mesh` around a block;
- service by service against an etcd of the caller's: `service_argv` is each service's command
  line and `READY` what each prints once it serves (tests/procs.py's `ServiceMesh`, the chaos
  run's and the hosts run's meshes).

A start that fails stops what it started: no process of ours outlives its caller.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Self

from services.mesh.discovery import (DECODE_WORKER, FRONTEND, PREFILL_WORKER, PROCESSOR, ROUTER, InstanceInfo,
                                     component_prefix)
from services.mesh.etcd_store import CALL_TIMEOUT_S, EtcdStore
from services.mesh.net import free_port
from services.mesh.tls import TlsConfig
from testkit.proc import Proc, python_module
from testkit.proc_stat import cpu_seconds

# The module each service runs, and what it prints or logs once it serves, its instance id (or a
# worker process's ids, space-separated) in group 1.
MODULES = {ROUTER: "services.kv_router", PROCESSOR: "services.processor", FRONTEND: "services.frontend",
           PREFILL_WORKER: "services.prefill_worker", DECODE_WORKER: "services.decode_worker"}
READY = {ROUTER: r"router (\w+) \(", PROCESSOR: r"processor (\w+) for", FRONTEND: r"frontend (\w+) listening on",
         PREFILL_WORKER: r"prefill-worker ready: (.+)$", DECODE_WORKER: r"decode-worker ready: (.+)$"}


def service_argv(component: str, etcd_endpoints: str, namespace: str, *flags: str) -> list[str]:
    """The command line of one `component` ("kv-router", ...) joining `namespace` on etcd."""
    return python_module(MODULES[component], "--etcd-endpoints", etcd_endpoints, "--namespace", namespace, *flags)


async def instances(endpoints: Sequence[str], prefixes: Sequence[str], tls: TlsConfig | None = None,
                    timeout_s: int = CALL_TIMEOUT_S) -> list[list[InstanceInfo]]:
    """The instances registered in etcd now under each of `prefixes`, read over one connection;
    StoreUnavailable when etcd does not answer."""
    store = EtcdStore(tuple(endpoints), timeout_s, tls)
    try:
        await store.connect()
        out = []
        for prefix in prefixes:
            items, _ = await store.get_prefix(prefix)
            out.append([InstanceInfo.from_json(kv.value) for kv in items])
        return out
    finally:
        await store.close()


def registered(etcd: str, namespace: str, component: str, tls: TlsConfig | None = None) -> list[InstanceInfo]:
    """The instances of a component registered in etcd right now (blocking: not on an event loop)."""
    return asyncio.run(instances((etcd,), (component_prefix(namespace, component),), tls))[0]


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
