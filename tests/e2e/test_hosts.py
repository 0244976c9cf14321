"""The mesh across hosts (network namespaces on a bridge, `bench/hosts/`), its quick form: every
process on its own address, nothing registered on loopback, and three silent partitions under
load, each healed:

- a decode worker cut from every other host mid-stream: its requests move across hosts, exactly,
  and once healed it is registered again within a lease TTL plus 2 s, without a restart;
- a decode worker cut from etcd alone: it serves what it holds, gets no new work once etcd has
  dropped it, and comes back under its own instance id, without a restart;
- a prefill worker cut from the decode workers while one pulls its KV: the pull is given up at
  its deadline and the prompt prefilled locally.

And the launcher (`make run`) given `--host` runs its whole mesh, embedded etcd included, on that
address: READY names it, a client on another host is answered, nothing listens on loopback.

Every answer is checked by asking its prompt again on the healed mesh. Skipped, with the reason,
where namespaces cannot be made (not root)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from testkit.mesh import launched_mesh
from testkit.proc_stat import running
from bench.hosts.faults import EtcdOnlyCut, Fault, MidTransferCut
from bench.hosts.load import Row, under_load
from bench.chaos.mesh import MeshLayout
from bench.hosts.mesh import HostsMesh, hosts_for, isolate, rejoin
from bench.hosts.netns import PREFIX, Bed, remove_stale, unavailable
from services.mesh.discovery import DECODE_WORKER, FRONTEND, PREFILL_WORKER, PROCESSOR, ROUTER
from services.mesh.etcd_lease import LeaseConfig
from tests.procs import MODEL

WHY_NOT = unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")

LAYOUT = MeshLayout(routers=1, processors=1, prefill_workers=1, decode_workers=2)
TTL_S = LeaseConfig().ttl_s
HEALED_WITHIN_S = TTL_S + 2.0
RATE = 2.0
LAUNCH_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostsMesh]:
    with Bed(hosts_for(LAYOUT) + 1) as bed:  # the last host is the launcher's (its own mesh)
        placed = HostsMesh(bed, tmp_path_factory.mktemp("hosts"), LAYOUT)
        try:
            asyncio.run(placed.start())
            yield placed
        finally:
            codes = asyncio.run(placed.stop())
            assert all(code in (0, -15) for code in codes.values()), codes
    assert remove_stale(PREFIX) == []  # the bed took everything with it


async def _fault(mesh: HostsMesh, fault: Fault, hold_s: float, long_share: float = 0.0) -> Row:
    async with httpx.AsyncClient(timeout=120) as client:
        row = await under_load(mesh, client, fault, hold_s, RATE, long_share)
    assert row.tally.failures == []
    assert row.tally.exact == row.tally.sent > 0  # every request answered, exactly, none twice
    if row.recover_s is not None:
        assert row.recover_s <= HEALED_WITHIN_S, f"not whole again {row.recover_s:.1f}s after the heal"
    assert row.problem is None, row.problem
    return row


def test_every_process_serves_on_its_own_address(mesh: HostsMesh) -> None:
    async def addresses() -> set[str]:
        components = (ROUTER, PROCESSOR, FRONTEND, PREFILL_WORKER, DECODE_WORKER)
        return {i.address.rsplit(":", 1)[0] for c in components for i in await mesh.instances(c)}

    assert asyncio.run(addresses()) == {h.address for h in mesh.placed.values()}


def test_a_worker_cut_from_every_host_mid_stream_loses_nothing_and_rejoins(mesh: HostsMesh) -> None:
    victim = mesh.worker_hosts[0]
    pid = mesh.child("decode-worker-1").pid
    others = [h for h in mesh.bed.hosts if h is not victim]

    async def cut() -> None:
        isolate(victim, others)

    async def heal() -> None:
        rejoin(victim, others)

    asyncio.run(_fault(mesh, Fault("cut from every host", cut, heal, lambda: _whole(mesh)), hold_s=TTL_S + 2))
    assert running(pid), "the cut worker restarted instead of rejoining"


def test_a_worker_cut_from_etcd_alone_gets_no_new_work_and_rejoins_under_its_own_id(mesh: HostsMesh) -> None:
    # Two seconds for the routers to hear etcd's deletion: the machine running the suite is loaded.
    cut = EtcdOnlyCut(mesh, mesh.worker_hosts[-1], settle_s=2.0)
    asyncio.run(_fault(mesh, Fault("cut from etcd", cut.start, cut.end, cut.recovered, passed=cut.passed),
                       hold_s=TTL_S + 4))
    assert cut.counted_from is not None, "etcd never dropped the cut worker"
    assert cut.admitted_during > 0  # it served while its lease ran down...
    assert cut.admitted_after_drop == 0  # ...and nothing new once etcd had dropped it
    assert running(cut.pid), "the cut worker restarted instead of rejoining"


def test_a_prefill_worker_cut_mid_transfer_is_given_up_for_a_local_prefill(mesh: HostsMesh) -> None:
    cut = MidTransferCut(mesh, mesh.worker_hosts)
    started = time.monotonic()
    asyncio.run(_fault(mesh, Fault("cut mid-transfer", cut.start, cut.end, None, passed=cut.passed), hold_s=6.0,
                       long_share=1.0))
    assert cut.cut_at_handover, f"no KV handover in {time.monotonic() - started:.0f}s"
    assert asyncio.run(cut.fallbacks()).get("transfer", 0) >= 1, "no transfer was given up"


async def _whole(mesh: HostsMesh) -> bool:
    return not await mesh.missing()


def test_the_launcher_runs_a_whole_mesh_on_its_host_address_and_nothing_on_loopback(mesh: HostsMesh,
                                                                                  tmp_path: Path) -> None:
    host = mesh.bed.hosts[-1]  # a spare host: the launcher's embedded etcd and mesh are its own
    with launched_mesh("--host", host.address, "--engine", "mocker", "--speedup", "20", "--decode-workers", "1",
                       "--run-dir", str(tmp_path), timeout_s=LAUNCH_TIMEOUT_S, prefix=host.argv()) as launched:
        assert launched.base.startswith(f"http://{host.address}:"), f"READY names {launched.base}"
        r = httpx.post(f"{launched.base}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "from another host", "max_tokens": 8})
        assert r.status_code == 200, r.text
        listening = host.run("ss", "-Htln").stdout.split("\n")
        # gRPC may bind an IPv4 address as its IPv6-mapped form: the same address.
        addresses = {line.split()[3].rsplit(":", 1)[0].removeprefix("[::ffff:").removesuffix("]")
                     for line in listening if line.strip()}
        assert addresses == {host.address}, f"something listens elsewhere: {addresses}"
    assert launched.exit_code == 0, f"the launcher exited {launched.exit_code}"
