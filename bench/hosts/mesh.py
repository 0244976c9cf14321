"""A mesh placed across the bed's hosts, every process bound to its own host's address.

Layout (host index: what runs there): 1-3 an etcd member each (one 3-member cluster); 4 the
kv-router, processor and frontend; 5 onwards a mocker decode worker each. Every service gets
`--host <its address>`, so anything that still assumed loopback (an address registered in etcd,
a side port, NIXL metadata) shows up as a peer that cannot be reached.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from bench.chaos.procs import Child, ChildFailed, spawn
from bench.hosts.netns import Bed, Host
from services.launch.readiness import ready_pattern
from services.mesh.discovery import InstanceInfo, component_prefix
from services.mesh.etcd_member import EtcdMember
from services.mesh.etcd_store import EtcdStore
from services.tools.make_demo_model import ensure_demo_model

ETCD_CLIENT_PORT, ETCD_PEER_PORT = 2379, 2380
HTTP_PORT = 8000
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0
# The mocker's default clock (an 8B model on an H100-class GPU): a 200-token answer takes ~2.5 s,
# long enough to cut a worker mid-stream.
SPEEDUP = 1.0


@dataclass
class HostsMesh:
    bed: Bed
    run_dir: Path
    namespace: str = "hosts"
    speedup: float = SPEEDUP
    children: list[Child] = field(default_factory=list)

    @property
    def etcd_hosts(self) -> list[Host]:
        return self.bed.hosts[:3]

    @property
    def front(self) -> Host:
        return self.bed.hosts[3]

    @property
    def worker_hosts(self) -> list[Host]:
        return self.bed.hosts[4:]

    @property
    def endpoints(self) -> str:
        return ",".join(f"http://{h.address}:{ETCD_CLIENT_PORT}" for h in self.etcd_hosts)

    @property
    def base_url(self) -> str:
        return f"http://{self.front.address}:{HTTP_PORT}/v1"

    async def instances(self, component: str, endpoints: tuple[str, ...] | None = None) -> list[InstanceInfo]:
        """The instances of `component` registered now, read through `endpoints` (default: the
        whole cluster). A read needs a quorum: through one member, it answers only while that
        member is part of one."""
        store = EtcdStore(endpoints or tuple(self.endpoints.split(",")), timeout_s=2)
        try:
            await store.connect()
            items, _ = await store.get_prefix(component_prefix(self.namespace, component))
        finally:
            await store.close()
        return [InstanceInfo.from_json(kv.value) for kv in items]

    async def start(self) -> None:
        if len(self.bed.hosts) < 5:
            raise ChildFailed("a mesh across hosts needs 5 hosts at least (3 etcd, 1 front, 1 worker)")
        await self._start_etcd()
        model = str(ensure_demo_model())
        front = self.front
        await self._service("kv-router", front, "services.kv_router")
        await self._service("processor", front, "services.processor", "--model", model)
        for i, host in enumerate(self.worker_hosts, start=1):
            await self._service(f"decode-worker-{i}", host, "services.decode_worker", "--engine", "mocker",
                                "--model", model, "--speedup", str(self.speedup), ready="decode-worker")
        await self._service("frontend", front, "services.frontend", "--http-port", str(HTTP_PORT))
        await self._healthy()

    async def _start_etcd(self) -> None:
        data = self.run_dir / "etcd-data"  # beside the logs, gone with the run directory
        members = [EtcdMember(f"e{h.index}", str(data / f"e{h.index}"), h.address, ETCD_CLIENT_PORT, ETCD_PEER_PORT,
                              extra=("--initial-cluster-state", "new", "--logger", "zap", "--log-level", "warn"))
                   for h in self.etcd_hosts]
        cluster = tuple((m.name, m.peer_url) for m in members)
        for host, member in zip(self.etcd_hosts, members, strict=True):
            argv = replace(member, cluster=cluster).argv()
            self.children.append(spawn(f"etcd-{member.name}", "etcd", host.argv(*argv), self.run_dir, self.namespace))

    async def _service(self, name: str, host: Host, module: str, *flags: str, ready: str | None = None) -> Child:
        argv = host.argv(sys.executable, "-m", module, "--etcd-endpoints", self.endpoints, "--namespace",
                         self.namespace, "--host", host.address, *flags)
        child = spawn(name, name, argv, self.run_dir, self.namespace)
        self.children.append(child)
        await child.wait_for_line(ready_pattern(ready or name).pattern, START_TIMEOUT_S)
        return child

    async def _healthy(self) -> None:
        deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                try:
                    if (await client.get(f"http://{self.front.address}:{HTTP_PORT}/health")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if asyncio.get_running_loop().time() > deadline:
                    raise ChildFailed(f"the frontend at {self.front.address} was not healthy within {START_TIMEOUT_S:.0f}s")
                await asyncio.sleep(0.25)

    async def stop(self) -> dict[str, int]:
        """Stops the services (frontend first, etcd last); returns each exit status."""
        codes: dict[str, int] = {}
        services = [c for c in reversed(self.children) if c.role != "etcd"]
        for child in [*services, *(c for c in self.children if c.role == "etcd")]:
            codes[child.name] = await child.stop(STOP_TIMEOUT_S)
        return codes


def isolate(host: Host, others: list[Host]) -> None:
    """Cuts `host` from every other host, both ways: a silent partition (no reset, no refusal)."""
    for other in others:
        host.cut_from(other)
        other.cut_from(host)


def rejoin(host: Host, others: list[Host]) -> None:
    for other in others:
        host.heal_from(other)
        other.heal_from(host)
