"""The chaos run's mesh: etcd plus every service as its own process, in one namespace.

Layout (`MeshLayout`): 2 kv-routers, 2 processors, 1 frontend, 2 prefill workers and 4 decode
workers on the mocker, disaggregated (decode workers prefill prompts of more than
`max_local_prefill_length` uncached tokens on the prefill workers over NIXL). Each process logs to
its own file in the run directory; `ChaosMesh` starts them, starts replacements, tells which
instances etcd lists, and stops everything at the end. etcd, each service's command line and the
line it prints once it serves are the test kit's (testkit/etcd.py, testkit/mesh.py).
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from bench.chaos.procs import RUN_MARKER, spawn
from services.mesh.discovery import (DECODE_WORKER, FRONTEND, PREFILL_WORKER, PROCESSOR, ROUTER, InstanceInfo,
                                     component_prefix)
from services.mesh.etcd_store import StoreUnavailable
from services.mesh.net import free_port
from testkit.etcd import Etcd
from testkit.mesh import MODULES, READY, instances, service_argv
from testkit.proc import Proc, ProcFailed

PREFILL, DECODE = PREFILL_WORKER, DECODE_WORKER
READY_TIMEOUT_S = 90.0


@dataclass(frozen=True)
class MeshLayout:
    routers: int = 2
    processors: int = 2
    prefill_workers: int = 2
    decode_workers: int = 4
    speedup: float = 1.0
    max_local_prefill_length: int = 256
    drain_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for role, n in self.counts().items():
            if n < (0 if role == PREFILL else 1):
                raise ValueError(f"a mesh needs at least {0 if role == PREFILL else 1} {role}, got {n}")

    def counts(self) -> dict[str, int]:
        return {ROUTER: self.routers, PROCESSOR: self.processors, FRONTEND: 1,
                PREFILL: self.prefill_workers, DECODE: self.decode_workers}

    def __str__(self) -> str:
        return ", ".join(f"{n} {role}" for role, n in self.counts().items() if n)


class ChaosMesh:
    """Every process of the run. `children` keeps all of them, dead or alive, in start order."""

    def __init__(self, run_dir: Path, namespace: str, layout: MeshLayout) -> None:
        self.run_dir = run_dir
        self.namespace = namespace
        self.layout = layout
        self.etcd = Etcd(data_dir=run_dir / "etcd-data", log_dir=run_dir, env={RUN_MARKER: namespace})
        self.http_port = free_port()
        self.children: list[Proc] = []
        self._numbers: dict[str, int] = {}

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def all_pids(self) -> set[int]:
        return {c.pid for c in self.children} | {c.pid for c in self.etcd.started}

    def live(self, role: str) -> list[Proc]:
        """The children of a role that are running, have announced themselves, and were not signalled."""
        return [c for c in self.children if c.role == role and c.alive and c.ready_at and not c.signalled]

    def name_of(self, instance_id: str) -> str:
        """The child name behind an instance id (from the ids the children announced)."""
        return next((c.name for c in self.children if instance_id in c.ids), instance_id)

    def spawn(self, role: str) -> Proc:
        """Starts one more process of `role` (not waiting for it to serve)."""
        number = self._numbers[role] = self._numbers.get(role, 0) + 1
        child = spawn(f"{role}-{number}", role, self._argv(role), self.run_dir, self.namespace)
        self.children.append(child)
        return child

    async def until_ready(self, child: Proc, timeout_s: float = READY_TIMEOUT_S) -> Proc:
        match = await child.wait_for_async(READY[child.role], timeout_s)
        child.ids = match.group(1).split()
        child.ready_at = time.monotonic()
        return child

    async def start(self) -> None:
        """etcd, then every service at once (2 cores: starting them one by one would take minutes),
        the frontend last; returns once /health answers 200 and etcd lists every instance."""
        await self.etcd.serve_async()
        first = [self.spawn(role) for role, n in self.layout.counts().items() if role != FRONTEND for _ in range(n)]
        await asyncio.gather(*(self.until_ready(c) for c in first))
        await self.until_ready(self.spawn(FRONTEND))
        if not await self.settled(60):
            raise ProcFailed(f"the mesh did not settle: registered {await self.registered_counts()}")

    def _argv(self, role: str) -> list[str]:
        lay = self.layout
        args = ["--drain-timeout", f"{lay.drain_timeout_s:g}"]
        if role == FRONTEND:
            args += ["--http-port", str(self.http_port)]
        elif role == ROUTER:
            args += ["--router-mode", "kv"]
        elif role in (PREFILL, DECODE):
            args += ["--engine", "mocker", "--speedup", f"{lay.speedup:g}", "--kv-transfer", "nixl"]
        if role == DECODE:
            args += ["--remote-prefill", "--max-local-prefill-length", str(lay.max_local_prefill_length)]
        return service_argv(role, self.etcd.endpoint, self.namespace, *args)

    # -- what etcd says ---------------------------------------------------------------------------

    async def registered(self, components: Sequence[str]) -> dict[str, list[InstanceInfo]]:
        """The instances etcd lists per component now; StoreUnavailable when etcd does not answer."""
        found = await instances(self.etcd.endpoints, [component_prefix(self.namespace, c) for c in components],
                                timeout_s=3)
        return dict(zip(components, found, strict=True))

    async def registered_counts(self) -> dict[str, int] | str:
        try:
            return {k: len(v) for k, v in (await self.registered(list(MODULES))).items()}
        except StoreUnavailable as exc:
            return f"etcd unavailable: {exc}"

    async def settled(self, timeout_s: float) -> bool:
        """True once etcd lists exactly the layout's instances (dead ones' leases have run out)
        and the frontend's /health answers 200."""
        deadline = time.monotonic() + timeout_s
        want = self.layout.counts()
        while time.monotonic() < deadline:
            if await self.registered_counts() == want and await self.healthy():
                return True
            await asyncio.sleep(0.5)
        return False

    async def healthy(self) -> bool:
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as session:
                async with session.get(f"{self.base_url}/health") as r:
                    return r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    # -- the end ----------------------------------------------------------------------------------

    async def stop(self) -> dict[str, int]:
        """SIGTERM to every service at once (each drain waits out its own delays), wait for the
        drain deadline plus a margin, SIGKILL what is left, then stop etcd. Returns the exit code
        of every service that was still running."""
        running = [c for c in self.children if c.alive]
        codes = await asyncio.gather(*(c.stop_async(self.layout.drain_timeout_s + 20) for c in running))
        await self.etcd.stop_async(10)
        # The logs are what a failed run keeps; etcd's preallocated WAL alone is 64 MB.
        shutil.rmtree(self.etcd.data_dir, ignore_errors=True)
        return {c.name: code for c, code in zip(running, codes)}
