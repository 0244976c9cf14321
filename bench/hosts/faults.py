"""The faults the bed puts a mesh through, one at a time, and how each one's recovery is told.

Every fault is silent, as a real network's are: packets are dropped where they arrive (nftables),
all of them or some at random, so nobody is refused or reset and each side learns of it by its
own deadlines and keep-alives. After the heal, a fault that took instances out of etcd has
recovered when they are registered again (`recovered`); what else the mesh had to do (no new
work to a worker etcd dropped, a cut transfer given up) is its `passed` verdict.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from bench.chaos.metrics import LOCAL, REMOTE, Reading, parse
from bench.hosts.links import LinkShape, shape, unshape
from bench.hosts.mesh import ETCD_CLIENT_PORT, HostsMesh, isolate, rejoin
from bench.hosts.netns import Host
from services.mesh.discovery import DECODE_WORKER
from testkit.proc import ProcFailed
from testkit.proc_stat import running

ETCDCTL_TIMEOUT_S = 10.0
# A handover is cut within a fraction of the ~1 s its transfer lasts: the log is read this often.
HANDOVER_POLL_S = 0.005


Check = Callable[[], Awaitable[bool]]
Verdict = Callable[[], Awaitable["str | None"]]


@dataclass(frozen=True)
class Fault:
    name: str
    start: Callable[[], Awaitable[None]]
    end: Callable[[], Awaitable[None]]
    # Whether the instances the fault took out of etcd are registered again; None where it takes
    # nobody out (the instance stays registered; its callers route around it for a while).
    recovered: Check | None
    # What the fault showed beyond the answers (a counter read before and after), for the table.
    note: Callable[[], Awaitable[str]] | None = None
    # What the mesh must have done besides answering (None when it did), for the goals.
    passed: Verdict | None = None
    hold_s: float | None = None  # None: the run's --cut


def faults(mesh: HostsMesh, loss_pct: float, loss_s: float) -> tuple[list[Fault], list[str]]:
    """The faults this layout and machine can have, and a line for each one they cannot (a processor
    cut from one of two routers needs two routers, a prefill worker's cut a prefill pool, the etcd
    leader's cut etcdctl)."""
    skipped = []
    everyone = mesh.bed.hosts
    decode = mesh.hosts_of("decode-worker")
    cut_all, cut_etcd = decode[0], decode[-1]
    full = _full_strength(mesh)
    found = [Fault("decode worker cut from every host, mid-stream", *_cut(cut_all, _others(everyone, cut_all)), full,
                   passed=_same_process(mesh, "decode-worker-1"))]
    etcd_only = EtcdOnlyCut(mesh, cut_etcd)
    found.append(Fault("decode worker cut from etcd only", etcd_only.start, etcd_only.end, etcd_only.recovered,
                       etcd_only.note, etcd_only.passed))
    if len(mesh.hosts_of("kv-router")) >= 2:
        processor, router = mesh.hosts_of("processor")[0], mesh.hosts_of("kv-router")[0]
        found.append(Fault("processor cut from one of two routers", *_cut(processor, [router]), None))
    else:
        skipped.append("processor cut from one of two routers: the layout has one router")
    if shutil.which("etcdctl") is not None:
        leader = LeaderCut(mesh)
        found.append(Fault("etcd leader cut from the other two members", leader.start, leader.end, leader.recovered,
                           leader.note))
    else:
        skipped.append("etcd leader cut: no etcdctl to find the leader with (apt-get install etcd-client)")
    if mesh.hosts_of("prefill-worker"):
        mid_transfer = MidTransferCut(mesh, decode)
        found.append(Fault("prefill worker cut from the decode workers during a NIXL transfer", mid_transfer.start,
                           mid_transfer.end, None, mid_transfer.note, mid_transfer.passed))
    else:
        skipped.append("prefill worker cut mid-transfer: the layout has no prefill worker")
    lossy = decode[1 % len(decode)]
    found.append(Fault(f"{loss_pct:g}% packet loss on a decode worker's link", *_lossy(lossy, loss_pct), None,
                       hold_s=loss_s))
    return found, skipped


def _same_process(mesh: HostsMesh, name: str) -> Verdict:
    pid = mesh.child(name).pid

    async def verdict() -> str | None:
        return None if running(pid) else f"{name} restarted instead of rejoining"

    return verdict


def _others(hosts: list[Host], host: Host) -> list[Host]:
    return [h for h in hosts if h is not host]


def _cut(host: Host, others: list[Host]) -> tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]:
    async def start() -> None:
        isolate(host, others)

    async def end() -> None:
        rejoin(host, others)

    return start, end


def _lossy(host: Host, loss_pct: float) -> tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]:
    async def start() -> None:
        shape(host, LinkShape(loss_pct=loss_pct))

    async def end() -> None:
        unshape(host)

    return start, end


def _full_strength(mesh: HostsMesh) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        try:
            return not await mesh.missing()
        except Exception:  # noqa: BLE001 - etcd busy for a moment: not yet, ask again
            return False

    return check


async def _reading(client: httpx.AsyncClient, host: str, port: int) -> Reading:
    """A decode worker's counters of where it prefilled (chaos run's parse), read from its /metrics."""
    return parse((await client.get(f"http://{host}:{port}/metrics")).text, DECODE_WORKER)


async def _decode_readings(mesh: HostsMesh) -> dict[str, Reading]:
    """Each decode worker etcd lists, by instance id."""
    async with httpx.AsyncClient(timeout=5) as client:
        return {i.instance_id: await _reading(client, i.address.rsplit(":", 1)[0], i.metrics_port)
                for i in await mesh.instances(DECODE_WORKER)}


class EtcdOnlyCut:
    """A decode worker cut from the etcd hosts alone: it stays reachable by everyone else while its
    lease lapses. What it must do: finish what it holds, get no new work once etcd has dropped it
    (the routers follow etcd), and come back under its own instance id, without a restart."""

    def __init__(self, mesh: HostsMesh, host: Host, settle_s: float = 1.0) -> None:
        """`settle_s`: how long after etcd dropped the worker the routers may still send it a
        request they chose just before they heard."""
        self.mesh, self.host = mesh, host
        self.settle_s = settle_s
        self.instance_id = ""
        self.metrics_port = 0
        self.dropped_at: float | None = None
        self.counted_from: float | None = None
        self.admitted_before = self.admitted_during = self.admitted_after_drop = 0.0
        self.pid = 0
        self._watching: asyncio.Task[None] | None = None

    async def _admitted(self) -> float:
        """The requests the worker admitted so far, read from it directly (etcd may not list it)."""
        async with httpx.AsyncClient(timeout=5) as client:
            reading = await _reading(client, self.host.address, self.metrics_port)
        return reading.values.get(LOCAL, 0.0) + reading.values.get(REMOTE, 0.0)

    async def start(self) -> None:
        (mine,) = [i for i in await self.mesh.instances(DECODE_WORKER) if i.address.startswith(f"{self.host.address}:")]
        self.instance_id, self.metrics_port = mine.instance_id, mine.metrics_port
        self.admitted_before = await self._admitted()
        self.pid = next(c.pid for c in self.mesh.children if self.mesh.placed.get(c.name) is self.host)
        isolate(self.host, self.mesh.etcd_hosts)
        self._watching = asyncio.get_running_loop().create_task(self._watch_drop())

    async def _watch_drop(self) -> None:
        """Once etcd no longer lists the worker (its lease lapsed), what it admits from then on."""
        while True:
            try:
                listed = any(i.instance_id == self.instance_id for i in await self.mesh.instances(DECODE_WORKER))
            except Exception:  # noqa: BLE001 - etcd busy: ask again
                listed = True
            if not listed:
                break
            await asyncio.sleep(0.2)
        self.dropped_at = asyncio.get_running_loop().time()
        # The routers hear of the deletion from their watch; a request routed just before it may
        # still land. `settle_s` later, nothing new may.
        await asyncio.sleep(self.settle_s)
        self.counted_from = await self._admitted()

    async def end(self) -> None:
        if self._watching is not None:
            self._watching.cancel()
            await asyncio.gather(self._watching, return_exceptions=True)
        self.admitted_during = await self._admitted() - self.admitted_before
        if self.counted_from is not None:
            self.admitted_after_drop = await self._admitted() - self.counted_from
        rejoin(self.host, self.mesh.etcd_hosts)

    async def recovered(self) -> bool:
        try:
            return any(i.instance_id == self.instance_id for i in await self.mesh.instances(DECODE_WORKER))
        except Exception:  # noqa: BLE001 - etcd busy: not yet
            return False

    async def passed(self) -> str | None:
        if self.counted_from is None:
            return f"etcd never dropped the worker cut from it (a cut shorter than the lease TTL + {self.settle_s:g} s?)"
        if self.admitted_after_drop and len(self.mesh.hosts_of("decode-worker")) > 1:
            return f"the worker etcd had dropped admitted {self.admitted_after_drop:.0f} new requests"
        return None if running(self.pid) else "the worker cut from etcd restarted instead of rejoining"

    async def note(self) -> str:
        if self.counted_from is None:
            return (f"etcd still listed it {self.settle_s:g} s before the heal (a cut shorter than the lease TTL + "
                    f"{self.settle_s:g} s?)")
        same = "same process" if running(self.pid) else "RESTARTED"
        return (f"admitted {self.admitted_during:.0f} requests during the cut, {self.admitted_after_drop:.0f} of them "
                f"from {self.settle_s:g} s after etcd dropped it; back under its own id {self.instance_id[:8]}, {same}")


class LeaderCut:
    """The etcd leader cut from the other two members (clients still reach all three): the two
    elect a new leader, the old one steps down, and after the heal it rejoins as a follower."""

    def __init__(self, mesh: HostsMesh) -> None:
        self.mesh = mesh
        self.host: Host | None = None
        self.new_leader = ""

    def _status(self) -> dict[str, tuple[int, int]]:
        """endpoint -> (its member id, the leader it knows), for the members that answer."""
        done = subprocess.run(["etcdctl", "--endpoints", self.mesh.endpoints, "--command-timeout=2s", "endpoint",
                               "status", "-w", "json"], capture_output=True, text=True, timeout=ETCDCTL_TIMEOUT_S)
        status = json.loads(done.stdout or "[]")
        # A member without a leader leaves the field out.
        return {s["Endpoint"]: (s["Status"]["header"]["member_id"], s["Status"].get("leader", 0)) for s in status}

    async def start(self) -> None:
        status = await asyncio.to_thread(self._status)
        leaders = {leader for _, leader in status.values() if leader}
        endpoint = next((e for e, (member, _) in status.items() if member in leaders), None)
        if len(leaders) != 1 or endpoint is None:
            raise RuntimeError(f"cannot tell the etcd leader: the members name {len(leaders)} leaders")
        self.host = next(h for h in self.mesh.etcd_hosts if f"//{h.address}:{ETCD_CLIENT_PORT}" in endpoint)
        isolate(self.host, _others(self.mesh.etcd_hosts, self.host))

    async def end(self) -> None:
        if self.host is None:  # the start failed before it cut anything
            return
        status = await asyncio.to_thread(self._status)
        others = {e: s for e, s in status.items() if self.host.address not in e}
        leaders = {leader for _, leader in others.values() if leader}
        self.new_leader = f"{len(leaders)} leader(s) among the other two" if leaders else "no answer from the other two"
        rejoin(self.host, _others(self.mesh.etcd_hosts, self.host))

    async def recovered(self) -> bool:
        """The old leader answers a read that needs a quorum, and the mesh is whole."""
        if self.host is None:
            return True
        try:
            await self.mesh.instances(DECODE_WORKER, (f"http://{self.host.address}:{ETCD_CLIENT_PORT}",))
        except Exception:  # noqa: BLE001 - still out of the quorum
            return False
        return await _full_strength(self.mesh)()

    async def note(self) -> str:
        if self.host is None:
            return "the leader was not found"
        return f"leader was on host {self.host.index}; during the cut: {self.new_leader}"


class MidTransferCut:
    """A prefill worker cut from the decode workers the moment it has handed a prompt's KV over
    (its "prefilled ... for remote decode" line): the decode worker is then pulling it. The link
    is held to 200 Mbit/s for the fault, so a transfer (22 MiB) lasts about a second and the cut
    lands in the middle of it. What the decode workers must do: give the transfer up at its deadline and
    prefill locally; count it."""

    LINK = LinkShape(rate_mbit=200)
    HANDOVER = r"prefilled \d+ tokens .* for remote decode"
    HANDOVER_TIMEOUT_S = 30.0

    def __init__(self, mesh: HostsMesh, decode: list[Host]) -> None:
        self.mesh, self.decode = mesh, decode
        self.name = "prefill-worker-1"
        self.host = mesh.placed[self.name]
        self.before: dict[str, float] = {}
        self.cut_at_handover = False
        self.waited_s = 0.0

    async def start(self) -> None:
        self.before = await self._totals()
        shape(self.host, self.LINK)
        began = time.monotonic()
        self.cut_at_handover = await self._next_handover()
        self.waited_s = time.monotonic() - began
        isolate(self.host, self.decode)

    async def end(self) -> None:
        rejoin(self.host, self.decode)
        unshape(self.host)

    async def _next_handover(self) -> bool:
        """Waits for the next handover in the worker's log; False when none came in time."""
        child = self.mesh.child(self.name)
        try:
            await child.wait_for_async(self.HANDOVER, self.HANDOVER_TIMEOUT_S, after=child.mark(),
                                       poll_s=HANDOVER_POLL_S)
        except ProcFailed:
            return False
        return True

    async def _totals(self) -> dict[str, float]:
        """The fallbacks the decode workers counted so far, by reason."""
        totals: dict[str, float] = {}
        for reading in (await _decode_readings(self.mesh)).values():
            for reason, value in reading.fallback_reasons.items():
                totals[reason] = totals.get(reason, 0.0) + value
        return totals

    async def fallbacks(self) -> dict[str, float]:
        """The remote prefills given up for local ones since the fault began, by reason."""
        after = await self._totals()
        return {r: after[r] - self.before.get(r, 0.0) for r in after if after[r] > self.before.get(r, 0.0)}

    async def passed(self) -> str | None:
        if not self.cut_at_handover:
            return f"no KV handover within {self.HANDOVER_TIMEOUT_S:.0f}s: the cut may have missed every transfer"
        return None if (await self.fallbacks()).get("transfer") else "no transfer was given up for a local prefill"

    async def note(self) -> str:
        grown = await self.fallbacks()
        when = (f"cut just after a handover ({self.waited_s:.1f}s in)" if self.cut_at_handover
                else f"no handover within {self.HANDOVER_TIMEOUT_S:.0f}s: cut at random")
        return f"{when}; fallbacks to local prefill: " + (", ".join(f"{n:.0f} {r}" for r, n in sorted(grown.items()))
                                                          or "none")
