"""Starting and stopping a whole local mesh (services.launch) for a benchmark."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from bench.common.proc_stat import cpu_seconds
from services.mesh.net import free_port


@dataclass
class LaunchedMesh:
    base: str
    # (component, pid) of every child the launcher started, etcd included.
    children: list[tuple[str, int]] = field(default_factory=list)
    # The launcher's exit status, once it was stopped (None while it runs, or if it had to be killed).
    exit_code: int | None = None

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


@contextmanager
def launched_mesh(*flags: str, timeout_s: float = 180, prefix: Sequence[str] = ()) -> Iterator[LaunchedMesh]:
    """The mesh once it is READY, with its children's pids and the base URL its READY line names;
    stopped afterwards (SIGTERM). `prefix`: what to run the launcher under (`ip netns exec ...`)."""
    port = free_port()
    argv = [*prefix, sys.executable, "-m", "services.launch", "--http-port", str(port), "--log-level", "WARNING",
            "--prefill-workers", "0", *flags]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.stdout is not None
    mesh = LaunchedMesh(f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + timeout_s
    try:
        for line in proc.stdout:
            if m := re.match(r"CHILD (\S+) pid=(\d+)", line):
                mesh.children.append((m.group(1), int(m.group(2))))
            if line.startswith("READY"):
                mesh.base = line.split()[1].removesuffix("/v1")  # where the launcher's --host put it
                break
            if time.monotonic() > deadline:
                raise RuntimeError("the mesh did not become ready in time")
        else:
            raise RuntimeError(f"the mesh exited before READY (code {proc.wait()})")
        yield mesh
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            mesh.exit_code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextmanager
def launched(*flags: str, timeout_s: float = 180) -> Iterator[str]:
    """Yields the mesh's base URL (http://127.0.0.1:PORT) once it is READY; stops it afterwards."""
    with launched_mesh(*flags, timeout_s=timeout_s) as mesh:
        yield mesh.base
