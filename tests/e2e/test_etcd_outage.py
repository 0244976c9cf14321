"""etcd can go away and come back: the mesh serves from its last known membership meanwhile,
every instance registers again and every watch resumes, nothing restarts, and no request in
between is answered 404 or 503 for want of a member."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.procs import Etcd, ServiceMesh, registered, wait_until

COMPONENTS = ("frontend", "processor", "kv-router", "decode-worker")
# Longer than the 10 s lease TTL (with 6 s to spare): every lease the mesh held has lapsed by the
# time etcd is back.
OUTAGE_S = 16.0


@pytest.fixture
def own_etcd() -> Iterator[Etcd]:
    server = Etcd.start()
    yield server
    server.stop()


def test_the_mesh_serves_through_an_etcd_outage_and_re_registers_after_it(own_etcd: Etcd) -> None:
    mesh = ServiceMesh(own_etcd.endpoint)
    try:
        mesh.worker()
        assert wait_until(lambda: mesh.complete("before", 2).status_code == 200, 30)
        before = members(mesh)
        assert all(before.values()), before

        own_etcd.halt()
        during = statuses(mesh, "during", OUTAGE_S, 0.5)
        assert set(during) == {200}, during

        own_etcd.resume()
        after = statuses(mesh, "after", 15, 0.25)
        assert set(after) == {200}, after
        # Every instance is registered again, under the id it had: nothing restarted.
        assert wait_until(lambda: members(mesh) == before, 30)
        assert all(p.popen.poll() is None for p in mesh.procs)
    finally:
        mesh.stop()


def test_every_lease_lost_at_once_turns_no_request_away(own_etcd: Etcd) -> None:
    """etcd forgets every lease (a restore, a long partition): each instance registers again on
    its own, and meanwhile the views keep their members instead of emptying."""
    mesh = ServiceMesh(own_etcd.endpoint)
    try:
        mesh.worker()
        assert wait_until(lambda: mesh.complete("before", 2).status_code == 200, 30)
        before = members(mesh)
        revoked = revoke_every_lease(own_etcd.endpoint)
        assert revoked >= len(COMPONENTS)
        meanwhile = statuses(mesh, "meanwhile", 8, 0.2)
        assert set(meanwhile) == {200}, meanwhile
        assert wait_until(lambda: members(mesh) == before, 15)
    finally:
        mesh.stop()


def members(mesh: ServiceMesh) -> dict[str, set[str]]:
    """The instance ids registered now, per component."""
    return {c: {i.instance_id for i in registered(mesh.etcd, mesh.namespace, c)} for c in COMPONENTS}


def statuses(mesh: ServiceMesh, prompt: str, seconds: float, every_s: float) -> list[int]:
    """The status of a small completion sent every `every_s` for `seconds`."""
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        out.append(mesh.complete(prompt, 2).status_code)
        time.sleep(every_s)
    return out


def revoke_every_lease(endpoint: str) -> int:
    """Revokes every lease the etcd server holds, with etcd's own client; returns how many."""
    etcdctl = shutil.which("etcdctl")
    assert etcdctl is not None, "etcdctl comes with etcd (etcd-client): run `make install`"
    env = {**os.environ, "ETCDCTL_API": "3"}
    out = subprocess.run([etcdctl, "--endpoints", endpoint, "lease", "list"], env=env, check=True,
                         capture_output=True, text=True, timeout=10).stdout.splitlines()
    leases = [line.strip() for line in out[1:] if line.strip()]  # after "found N leases"
    for lease in leases:
        subprocess.run([etcdctl, "--endpoints", endpoint, "lease", "revoke", lease], env=env, check=True,
                       capture_output=True, timeout=10)
    return len(leases)
