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
# Longer than the 10 s lease TTL: every lease the mesh held has lapsed by the time etcd is back.
OUTAGE_S = 30.0


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
        before = {c: {i.instance_id for i in registered(own_etcd.endpoint, mesh.namespace, c)} for c in COMPONENTS}
        assert all(before.values()), before

        own_etcd.halt()
        end = time.monotonic() + OUTAGE_S
        during = []
        while time.monotonic() < end:
            during.append(mesh.complete("during", 2).status_code)
            time.sleep(0.5)
        assert set(during) == {200}, during

        own_etcd.resume()
        after = []
        end = time.monotonic() + 15
        while time.monotonic() < end:
            after.append(mesh.complete("after", 2).status_code)
            time.sleep(0.25)
        assert set(after) == {200}, after
        # Every instance is registered again, under the id it had: nothing restarted.
        assert wait_until(lambda: all(
            {i.instance_id for i in registered(own_etcd.endpoint, mesh.namespace, c)} == before[c]
            for c in COMPONENTS), 30)
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
        before = {c: {i.instance_id for i in registered(own_etcd.endpoint, mesh.namespace, c)} for c in COMPONENTS}
        revoked = revoke_every_lease(own_etcd.endpoint)
        assert revoked >= len(COMPONENTS)
        statuses = []
        end = time.monotonic() + 8
        while time.monotonic() < end:
            statuses.append(mesh.complete("meanwhile", 2).status_code)
            time.sleep(0.2)
        assert set(statuses) == {200}, statuses
        assert wait_until(lambda: all(
            {i.instance_id for i in registered(own_etcd.endpoint, mesh.namespace, c)} == before[c]
            for c in COMPONENTS), 15)
    finally:
        mesh.stop()


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
