"""A mesh placed across the bed's hosts, every process bound to its own host's address.

Hosts 1-3 run an etcd member each (one 3-member cluster); then every service instance of the
layout (the chaos run's `MeshLayout`) gets a host of its own, in this order: the frontend,
processors, routers, prefill workers, decode workers (mockers, or vLLM). Every service gets
`--host <its address>`, so anything that still assumed loopback (an address registered in etcd,
a side port, NIXL metadata) shows up as a peer that cannot be reached.

NIXL goes over TCP on the hosts' interfaces (`UCX_TLS=tcp`): between namespaces of one machine
UCX would otherwise pick shared memory, which no partition of the network cuts, and a transfer
"between hosts" would not cross the network at all.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.chaos.mesh import DECODE, FRONTEND, PREFILL, PROCESSOR, ROUTER, MeshLayout
from bench.chaos.procs import RUN_MARKER, spawn
from bench.hosts.netns import Bed, Host
from services.mesh.discovery import InstanceInfo, component_prefix, instances_prefix
from services.tools.make_demo_model import ensure_demo_model
from testkit.etcd import Etcd
from testkit.mesh import READY, instances, service_argv
from testkit.proc import Proc, ProcFailed

ETCD_CLIENT_PORT, ETCD_PEER_PORT = 2379, 2380
ETCD_MEMBERS = 3
HTTP_PORT = 8000
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0
# KV per token of a small model (8 layers x 8 KV heads x 128 dims x K and V x 2 bytes): a
# 700-token prompt moves 22 MiB, so a transfer on a slow link lasts long enough to be cut in the
# middle, and the mocker's 256 MiB of KV held for pulling fits eleven of them.
KV_BYTES_PER_TOKEN = 32 << 10
WORKER_ENV = {"UCX_TLS": "tcp"}
# The order hosts are given out in: the front first, the workers last.
ORDER = (FRONTEND, PROCESSOR, ROUTER, PREFILL, DECODE)


def hosts_for(layout: MeshLayout) -> int:
    """The hosts a bed needs for `layout`: the etcd members, then one per service instance."""
    return ETCD_MEMBERS + sum(layout.counts().values())


@dataclass
class HostsMesh:
    bed: Bed
    run_dir: Path
    layout: MeshLayout = MeshLayout(routers=1, processors=1, prefill_workers=0, decode_workers=2)
    namespace: str = "hosts"
    # "mocker", or "vllm" (the demo model; on CPU, one or two workers at most).
    engine: str = "mocker"
    # The services' processes; etcd's are `etcd.procs`.
    children: list[Proc] = field(default_factory=list)
    etcd: Etcd | None = None
    # Service instance name ("decode-worker-2") -> its host.
    placed: dict[str, Host] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.engine not in ("mocker", "vllm"):
            raise ValueError(f"engine is mocker or vllm, not {self.engine!r}")
        if len(self.bed.hosts) < hosts_for(self.layout):
            raise ProcFailed(f"the layout ({self.layout}) needs {hosts_for(self.layout)} hosts, the bed has "
                             f"{len(self.bed.hosts)}")
        free = iter(self.bed.hosts[ETCD_MEMBERS:])
        for kind in ORDER:
            for i in range(1, self.layout.counts()[kind] + 1):
                self.placed[f"{kind}-{i}"] = next(free)

    def hosts_of(self, kind: str) -> list[Host]:
        """The hosts running `kind` ("decode-worker", ...), in instance order."""
        return [host for name, host in self.placed.items() if name.rsplit("-", 1)[0] == kind]

    @property
    def etcd_hosts(self) -> list[Host]:
        return self.bed.hosts[:ETCD_MEMBERS]

    @property
    def front(self) -> Host:
        return self.hosts_of("frontend")[0]

    @property
    def worker_hosts(self) -> list[Host]:
        return self.hosts_of("decode-worker")

    @property
    def endpoints(self) -> str:
        return ",".join(f"http://{h.address}:{ETCD_CLIENT_PORT}" for h in self.etcd_hosts)

    @property
    def base_url(self) -> str:
        return f"http://{self.front.address}:{HTTP_PORT}/v1"

    def child(self, name: str) -> Proc:
        return next(c for c in self.children if c.name == name)

    async def instances(self, component: str, endpoints: tuple[str, ...] | None = None) -> list[InstanceInfo]:
        """The instances of `component` registered now, read through `endpoints` (default: the
        whole cluster). A read needs a quorum: through one member, it answers only while that
        member is part of one."""
        return await self._registered(component_prefix(self.namespace, component), endpoints)

    async def missing(self) -> list[str]:
        """The service instances not registered in etcd now (empty: the mesh is at full strength);
        an instance is known by its host's address. One read of every component's instances."""
        registered = {i.address.rsplit(":", 1)[0] for i in await self._registered(instances_prefix(self.namespace))}
        return [name for name, host in self.placed.items() if host.address not in registered]

    async def _registered(self, prefix: str, endpoints: tuple[str, ...] | None = None) -> list[InstanceInfo]:
        return (await instances(endpoints or self.endpoints.split(","), (prefix,), timeout_s=2))[0]

    async def start(self) -> None:
        await self._start_etcd()
        model = str(ensure_demo_model())
        engine: tuple[str, ...] = ("--engine", self.engine, "--model", model)
        if self.engine == "mocker":
            engine += ("--speedup", str(self.layout.speedup), "--kv-bytes-per-token", str(KV_BYTES_PER_TOKEN))
        if self.layout.prefill_workers:
            engine += ("--kv-transfer", "nixl")
        decode = ("--max-local-prefill-length", str(self.layout.max_local_prefill_length))
        flags = {FRONTEND: ("--http-port", str(HTTP_PORT)), PROCESSOR: ("--model", model), ROUTER: (),
                 PREFILL: engine, DECODE: engine + decode}
        waits = []
        for name, host in self.placed.items():
            kind = name.rsplit("-", 1)[0]
            env = WORKER_ENV if kind.endswith("-worker") else None
            waits.append(self._service(name, host, kind, *flags[kind], env=env))
        await asyncio.gather(*waits)
        await self._healthy()

    async def _start_etcd(self) -> None:
        """One member on each etcd host, not waited for: the services wait for etcd themselves."""
        hosts = self.etcd_hosts
        self.etcd = Etcd(len(hosts), hosts=[h.address for h in hosts], client_port=ETCD_CLIENT_PORT,
                         peer_port=ETCD_PEER_PORT, data_dir=self.run_dir / "etcd-data",  # gone with the run directory
                         extra=("--logger", "zap", "--log-level", "warn"), log_dir=self.run_dir,
                         env={RUN_MARKER: self.namespace}, wrap=lambda i, argv: hosts[i].argv(*argv))
        self.etcd.launch()

    async def _service(self, name: str, host: Host, kind: str, *flags: str, env: dict[str, str] | None) -> Proc:
        argv = host.argv(*service_argv(kind, self.endpoints, self.namespace, "--host", host.address, *flags))
        child = spawn(name, kind, argv, self.run_dir, self.namespace, env)
        self.children.append(child)
        await child.wait_for_async(READY[kind], START_TIMEOUT_S)
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
                    raise ProcFailed(f"the frontend at {self.front.address} was not healthy within {START_TIMEOUT_S:.0f}s")
                await asyncio.sleep(0.25)

    async def stop(self) -> dict[str, int]:
        """Stops the services together, then etcd; returns each exit status."""
        codes = await asyncio.gather(*(c.stop_async(STOP_TIMEOUT_S) for c in self.children))
        out = {child.name: code for child, code in zip(self.children, codes, strict=True)}
        if self.etcd is not None:
            out |= await self.etcd.stop_async(STOP_TIMEOUT_S)
        return out


def isolate(host: Host, others: list[Host]) -> None:
    """Cuts `host` from every other host, both ways: a silent partition (no reset, no refusal)."""
    for other in others:
        host.cut_from(other)
        other.cut_from(host)


def rejoin(host: Host, others: list[Host]) -> None:
    for other in others:
        host.heal_from(other)
        other.heal_from(host)
