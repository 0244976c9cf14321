"""A router that knows when its index is wrong, on a mesh of mocker workers: a worker whose KV
event stream falls silent (the SIGUSR2 drill) is predicted and followed again, a worker restarted
under the same address leaves none of its old blocks, and routing without any KV events still
keeps a shared prefix on one worker."""

from __future__ import annotations

import os
import signal
import time

import pytest

from services.mesh.discovery import DECODE_WORKER
from services.mesh.net import free_port
from tests.e2e.test_kv_routing import prefix
from testkit.metrics import find
from tests.procs import Etcd, ServiceMesh, registered, wait_until

# The benchmark's goal for the drill: the fallback engaged within this of the silence.
FALLBACK_WITHIN_S = 10.0


def sample(mesh: ServiceMesh, name: str, **labels: str) -> float | None:
    """The kv-router's sample of that name and labels (in whatever order the exposition writes them)."""
    return find(mesh.metrics("kv-router"), name, **labels)


def kv_source(mesh: ServiceMesh, worker: str) -> float | None:
    return sample(mesh, "kvmesh_router_kv_source", worker_id=worker)


def test_a_worker_whose_events_fall_silent_is_predicted_and_followed_again(etcd: Etcd) -> None:
    with ServiceMesh(etcd.endpoint, router_mode="kv") as mesh:
        proc, (wid,) = mesh.worker()
        assert wait_until(lambda: mesh.complete().status_code == 200, 20)
        assert wait_until(lambda: kv_source(mesh, wid) == 0, 5)

        os.kill(proc.popen.pid, signal.SIGUSR2)  # the drill: the stream stays open and says nothing
        silenced = time.monotonic()
        assert wait_until(lambda: kv_source(mesh, wid) == 1, FALLBACK_WITHIN_S), mesh.procs[0].tail()
        assert time.monotonic() - silenced < FALLBACK_WITHIN_S
        mesh.procs[0].wait_for(rf"worker {wid}: routing on a prediction of its cache .*\(stream_lost\)", 5)
        # It keeps serving, and its prefixes are predicted from what the router sends it.
        shared = prefix(41, blocks=8)
        assert mesh.complete(shared + [1]).status_code == 200
        assert mesh.complete(shared + [2]).headers["x-kvmesh-worker"] == wid

        os.kill(proc.popen.pid, signal.SIGUSR2)  # published again: the held events flow
        assert wait_until(lambda: kv_source(mesh, wid) == 0, FALLBACK_WITHIN_S), mesh.procs[0].tail()
        mesh.procs[0].wait_for(rf"worker {wid}: routing on its KV events again \(stream_back\)", 5)
        assert wait_until(lambda: mesh.find_matches(shared) == {wid: 8}, 5), mesh.find_matches(shared)
        switches = sample(mesh, "kvmesh_router_kv_source_switches_total", worker_id=wid, source="predicted",
                          reason="stream_lost")
        assert switches == 1


def test_a_worker_restarted_under_the_same_address_leaves_none_of_its_old_blocks(etcd: Etcd) -> None:
    with ServiceMesh(etcd.endpoint, router_mode="kv") as mesh:
        port = free_port()
        old, (old_id,) = mesh.worker("--port", str(port))
        shared = prefix(77)
        assert wait_until(lambda: mesh.complete(shared).status_code == 200, 20)
        assert wait_until(lambda: mesh.find_matches(shared) == {old_id: 16}, 5)

        old.kill()
        killed = time.monotonic()
        _, (new_id,) = mesh.worker("--port", str(port))
        assert new_id != old_id
        # Well before the old lease runs out (10 s), the old worker's blocks are gone from the index.
        assert wait_until(lambda: mesh.find_matches(shared) == {}, 5), mesh.find_matches(shared)
        elapsed = time.monotonic() - killed
        if old_id in {i.instance_id for i in registered(mesh.etcd, mesh.namespace, DECODE_WORKER)}:
            assert elapsed < 10  # the lease had not run out: the restart itself dropped them
        mesh.procs[0].wait_for(rf"worker {old_id}: its address .* now serves worker {new_id}", 5)
        # The new worker's own blocks are its own.
        assert mesh.complete(shared).headers["x-kvmesh-worker"] == new_id
        assert wait_until(lambda: mesh.find_matches(shared) == {new_id: 16}, 5), mesh.find_matches(shared)


@pytest.mark.parametrize("off_at", ["router", "worker"])
def test_without_kv_events_a_shared_prefix_goes_back_to_the_worker_it_was_routed_to(etcd: Etcd, off_at: str) -> None:
    router_flags = ("--kv-events", "off") if off_at == "router" else ()
    worker_flags = ("--kv-events", "off") if off_at == "worker" else ()
    with ServiceMesh(etcd.endpoint, router_mode="kv", router_flags=router_flags) as mesh:
        _, ids = mesh.worker("--num-workers", "4", *worker_flags)
        assert wait_until(lambda: mesh.complete().status_code == 200, 20)
        assert all(kv_source(mesh, w) == 1 for w in ids)
        for p in range(3):
            shared = prefix(600 + p, blocks=8)
            home = mesh.complete(shared + [1]).headers["x-kvmesh-worker"]
            for suffix in range(3):
                r = mesh.complete(shared + [50 + suffix])
                assert r.headers["x-kvmesh-worker"] == home
                assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 8 * 16
        assert mesh.find_matches(prefix(600, blocks=8)) == {}  # the index knows nothing: no events
