"""Child processes for the chaos run: services and etcd, each with its output in a log file.

Unlike the shared starter's `Proc` (bench/common/mesh_process.py: output kept in memory, read on
a thread), a chaos child writes a log file the run keeps. Everything is asyncio-friendly (polling
with short sleeps, never blocking the event loop for long): the load, the faults and the metrics
scraper share one loop. Every child gets the environment variable
`KVMESH_CHAOS_RUN=<namespace>`, so `leftovers` can find anything of the run still alive at the
end, even a grandchild that was reparented to init.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common.proc_stat import stat_fields
from services.mesh.etcd_member import EtcdMember
from services.mesh.net import accepts_connections, free_port

ROOT = Path(__file__).resolve().parents[2]
RUN_MARKER = "KVMESH_CHAOS_RUN"
POLL_S = 0.1


class ChildFailed(RuntimeError):
    """A child exited or stayed silent where it should have said it is serving."""


@dataclass
class Child:
    """One process of the run: its argv, its log file, and (after `ready`) the ids it announced."""

    name: str
    role: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    started_at: float = field(default_factory=time.monotonic)
    ids: list[str] = field(default_factory=list)
    ready_at: float | None = None
    signalled: str = ""  # what the run did to it on purpose: "SIGKILL", "SIGTERM", or "" (stopped at the end)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def log_size(self) -> int:
        """Bytes in the log so far: where a wait for a line still to come starts (`after`)."""
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    async def wait_for_line(self, pattern: str, timeout_s: float, after: int = 0,
                            poll_s: float = POLL_S) -> re.Match[str]:
        """The first log line from byte `after` on matching `pattern`, the log read as it grows;
        ChildFailed when the child exits or the time is up."""
        regex = re.compile(pattern, re.MULTILINE)
        deadline = time.monotonic() + timeout_s
        seen = b""
        with self.log_path.open("rb") as log:
            log.seek(after)
            while True:
                seen += log.read()
                if match := regex.search(seen.decode(errors="replace")):
                    return match
                if not self.alive:
                    raise ChildFailed(f"{self.name} exited ({self.popen.returncode}) before {pattern!r}:\n{self.tail()}")
                if time.monotonic() > deadline:
                    raise ChildFailed(f"{self.name}: no {pattern!r} within {timeout_s:.0f}s:\n{self.tail()}")
                await asyncio.sleep(poll_s)

    def send(self, sig: signal.Signals) -> None:
        if self.alive:
            self.popen.send_signal(sig)

    async def wait(self, timeout_s: float) -> int | None:
        """The exit status, or None when it is still running after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.popen.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        return self.popen.poll()

    async def stop(self, timeout_s: float) -> int:
        """SIGTERM, wait up to `timeout_s`, then SIGKILL; returns the exit status."""
        self.send(signal.SIGTERM)
        code = await self.wait(timeout_s)
        if code is None:
            self.send(signal.SIGKILL)
            code = await self.wait(10)
        return code if code is not None else -999


def spawn(name: str, role: str, argv: list[str], run_dir: Path, namespace: str,
          env: dict[str, str] | None = None) -> Child:
    """Starts `argv` in the repository root with stdout and stderr in `run_dir/<name>.log`, with
    `env` on top of this process's environment."""
    log_path = run_dir / f"{name}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{RUN_MARKER: namespace}, **(env or {}))
    with log_path.open("wb") as log:
        popen = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT)
    return Child(name, role, popen, log_path)


async def port_open(port: int, timeout_s: float) -> bool:
    """Whether something accepts connections on 127.0.0.1:`port` within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await accepts_connections("127.0.0.1", port):
            return True
        await asyncio.sleep(POLL_S)
    return False


class EtcdServer:
    """A single-member etcd on fixed loopback ports and a data dir in the run directory.

    `halt` stops it keeping its data; `resume` starts the same member again on the same ports
    and data dir, which is what an etcd outage looks like to the mesh."""

    def __init__(self, run_dir: Path, namespace: str) -> None:
        self.member = EtcdMember("chaos", str(run_dir / "etcd-data"), "127.0.0.1", free_port(), free_port())
        try:
            self._argv = self.member.argv()
        except FileNotFoundError as exc:
            raise ChildFailed(str(exc)) from exc
        self._run_dir = run_dir
        self._namespace = namespace
        self.children: list[Child] = []

    @property
    def endpoint(self) -> str:
        return self.member.endpoint

    @property
    def current(self) -> Child | None:
        return self.children[-1] if self.children else None

    async def start(self) -> None:
        """Starts (or restarts) the member and waits until its client port accepts connections."""
        child = spawn(f"etcd-{len(self.children) + 1}", "etcd", self._argv, self._run_dir, self._namespace)
        self.children.append(child)
        if not await port_open(self.member.client_port, 20):
            raise ChildFailed(f"etcd did not open port {self.member.client_port}:\n{child.tail()}")

    async def halt(self) -> int:
        """Stops the member (SIGTERM, then SIGKILL after 10 s), keeping its data dir."""
        child = self.current
        if child is None:
            return 0
        child.signalled = "SIGTERM"
        return await child.stop(10)


@dataclass(frozen=True)
class Leftover:
    pid: int
    cmdline: str
    why: str


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _ppid_and_state(pid: int) -> tuple[int, str]:
    fields = stat_fields(pid)
    return (int(fields[1]), fields[0]) if fields is not None and len(fields) > 1 else (0, "?")


def leftovers(namespace: str, our_pids: set[int]) -> list[Leftover]:
    """Live processes of this run: the namespace in their command line, the run's marker in
    their environment, or a parent that was one of our children."""
    found = []
    marker = f"{RUN_MARKER}={namespace}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        ppid, state = _ppid_and_state(pid)
        if state in ("Z", "X", "?"):
            continue
        cmdline = _read(entry / "cmdline").replace(b"\0", b" ").decode(errors="replace").strip()
        why = ""
        if namespace in cmdline:
            why = "command line names the run's namespace"
        elif marker in _read(entry / "environ").split(b"\0"):
            why = "environment carries the run's marker"
        elif ppid in our_pids:
            why = f"child of our process {ppid}"
        if why:
            found.append(Leftover(pid, cmdline[:200], why))
    return found
