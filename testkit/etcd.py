"""The one etcd starter of the tests and the benchmarks: `Etcd`, one member or a cluster of
several, plain or serving its clients over mutual TLS.

Each member's command line is services/mesh/etcd_member.py's (the launcher's own); its process is
a `Proc`. Where the data lives is the caller's (`data_dir`, e.g. a run's directory) or a fresh
temporary directory, removed by `stop`. `halt` stops the members keeping their data, and `resume`
starts the same members again on the same ports: an etcd outage, as a mesh sees one.

Ready means every member's client port accepts connections and, for a cluster, etcd's own client
finds every endpoint healthy (the members have a leader). `start` blocks until then; a run on an
event loop uses `serve_async`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from services.mesh.etcd_member import EtcdMember
from services.mesh.net import accepts_connections, free_port
from testkit.proc import POLL_S, Proc, ProcFailed

READY_TIMEOUT_S = 20.0
CLUSTER_READY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class EtcdTls:
    """The files of a member that serves its clients over TLS and asks each for a certificate."""

    cert: Path
    key: Path
    ca: Path

    def flags(self) -> tuple[str, ...]:
        return ("--cert-file", str(self.cert), "--key-file", str(self.key), "--trusted-ca-file", str(self.ca),
                "--client-cert-auth")


class Etcd:
    """etcd members, one cluster; `procs` their running processes (the latest start of each),
    `started` every process started, restarts included, in order."""

    def __init__(self, size: int = 1, *, hosts: Sequence[str] = ("127.0.0.1",), client_port: int | None = None,
                 peer_port: int | None = None, data_dir: Path | None = None, tls: EtcdTls | None = None,
                 extra: Sequence[str] = (), log_dir: Path | None = None, env: dict[str, str] | None = None,
                 wrap: Callable[[int, list[str]], list[str]] | None = None, name: str = "etcd") -> None:
        """`size` members named m0, m1, ... (one member: `name`'s own), member i on `hosts[i]` (the
        last host for the rest); free ports on loopback unless `client_port` / `peer_port` say
        (each member on its own host may use the same). `extra`: flags for every member.
        `log_dir`: each process's output in `<log_dir>/<process name>.log`, else in memory.
        `wrap(i, argv)`: the command line that runs member i's `argv` (`ip netns exec ...`)."""
        self.name = name
        self.tls = tls
        self._owned = data_dir is None
        self.data_dir = Path(tempfile.mkdtemp(prefix="kvmesh-test-etcd-")) if data_dir is None else data_dir
        self.log_dir = log_dir
        self.env = env
        self.wrap = wrap
        flags = (*(tls.flags() if tls else ()), *extra, *(("--initial-cluster-state", "new") if size > 1 else ()))
        members = []
        for i in range(size):
            host = hosts[min(i, len(hosts) - 1)]
            member_name = name if size == 1 else f"m{i}"
            members.append(EtcdMember(member_name, str(self.data_dir / member_name), host,
                                      client_port or free_port(host), peer_port or free_port(host), extra=flags,
                                      client_scheme="https" if tls else "http"))
        cluster = tuple((m.name, m.peer_url) for m in members) if size > 1 else ()
        self.members = [replace(m, cluster=cluster) for m in members]
        self.procs: list[Proc] = []
        self.started: list[Proc] = []

    # -- where it is ------------------------------------------------------------------------------

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    @property
    def endpoint(self) -> str:
        """The first member's client URL (a single server's)."""
        return self.members[0].endpoint

    @property
    def client_port(self) -> int:
        return self.members[0].client_port

    @property
    def proc(self) -> Proc | None:
        """The first member's running process, if started."""
        return self.procs[0] if self.procs else None

    # -- starting ---------------------------------------------------------------------------------

    @classmethod
    def start(cls, size: int = 1, **options: Any) -> Etcd:
        """`Etcd(size, **options)` started and ready (blocking); stopped again, data and all, when
        it does not get ready. RuntimeError where etcd is not installed or does not start."""
        etcd = cls(size, **options)
        try:
            etcd.launch()
            etcd.ready()
        except BaseException:
            etcd.stop()
            raise
        return etcd

    @classmethod
    @contextmanager
    def running(cls, size: int = 1, **options: Any) -> Iterator[Etcd]:
        """`start` for the block; stopped (and its own data removed) after it."""
        etcd = cls.start(size, **options)
        try:
            yield etcd
        finally:
            etcd.stop()

    def launch(self) -> None:
        """Starts every member's process, without waiting for it to serve; ProcFailed where etcd
        is not installed."""
        procs = []
        for i, member in enumerate(self.members):
            try:
                argv = member.argv()
            except FileNotFoundError as exc:
                raise ProcFailed(str(exc)) from exc
            if self.wrap is not None:
                argv = self.wrap(i, argv)
            name = self.name if len(self.members) == 1 else f"{self.name}-{member.name}"
            if any(p.name == name for p in self.started):  # a restart: a name (and a log) of its own
                name = f"{name}-{1 + sum(p.name.startswith(name) for p in self.started)}"
            log = self.log_dir / f"{name}.log" if self.log_dir is not None else None
            procs.append(Proc(argv, name, self.env, log=log, role="etcd"))
        self.procs = procs
        self.started += procs

    def _not_ready(self, why: str) -> ProcFailed:
        return ProcFailed(f"{why}:\n" + "\n".join(f"[{p.name}] {p.tail(15)}" for p in self.procs))

    def ready(self, timeout_s: float | None = None) -> None:
        """Blocks until every member serves (and a cluster is healthy); ProcFailed otherwise."""
        deadline = time.monotonic() + (timeout_s or READY_TIMEOUT_S)
        for member in self.members:
            while True:
                try:
                    socket.create_connection((member.host, member.client_port), 0.5).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise self._not_ready(f"etcd did not start (port {member.client_port})") from None
                    time.sleep(POLL_S)
        if len(self.members) > 1:
            deadline = time.monotonic() + (timeout_s or CLUSTER_READY_TIMEOUT_S)
            while not self.healthy():
                if time.monotonic() > deadline:
                    raise self._not_ready("the etcd cluster did not become healthy")
                time.sleep(0.2)

    async def ready_async(self, timeout_s: float | None = None) -> None:
        """`ready` on the event loop, for a single member: its client port accepting connections."""
        deadline = time.monotonic() + (timeout_s or READY_TIMEOUT_S)
        for member in self.members:
            while not await accepts_connections(member.host, member.client_port):
                if time.monotonic() > deadline:
                    raise self._not_ready(f"etcd did not open port {member.client_port}")
                await asyncio.sleep(POLL_S)

    def healthy(self) -> bool:
        """Whether etcd's own client finds every endpoint healthy (False without etcdctl)."""
        etcdctl = shutil.which("etcdctl")
        if etcdctl is None:
            return False
        env = {**os.environ, "ETCDCTL_API": "3"}
        try:
            done = subprocess.run([etcdctl, "--endpoints", ",".join(self.endpoints), "endpoint", "health"], env=env,
                                  capture_output=True, timeout=10)
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0

    # -- outages and the end ----------------------------------------------------------------------

    def halt(self) -> None:
        """Stops the members, keeping their data: `resume` brings the same cluster back."""
        for proc in self.procs:
            proc.stop()

    def resume(self) -> None:
        self.launch()
        self.ready()

    async def halt_async(self) -> int:
        """`halt` on the event loop (SIGTERM, SIGKILL after 10 s); the first member's exit status."""
        codes = []
        for proc in self.procs:
            proc.signalled = "SIGTERM"
            codes.append(await proc.stop_async(10))
        return codes[0] if codes else 0

    async def serve_async(self, timeout_s: float | None = None) -> None:
        """Starts every member (again, after `halt_async`) and waits on the event loop until it serves."""
        self.launch()
        await self.ready_async(timeout_s)

    def stop(self) -> None:
        """Stops every member; removes the data where it was a temporary directory of our own."""
        for proc in self.procs:
            proc.stop()
        if self._owned:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    async def stop_async(self, timeout_s: float = 10) -> dict[str, int]:
        """Stops every member on the event loop; each one's exit status by process name."""
        codes = await asyncio.gather(*(p.stop_async(timeout_s) for p in self.procs))
        if self._owned:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        return {p.name: code for p, code in zip(self.procs, codes, strict=True)}
