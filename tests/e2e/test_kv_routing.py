"""KV-aware routing on a mesh of mocker workers: stickiness, lost workers, router restarts."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator

import pytest

from services.mesh.discovery import DECODE_WORKER
from tests.procs import Etcd, ServiceMesh, registered, wait_until

BLOCK = 16
LEASE_TTL_S = 10


def prefix(seed: int, blocks: int = 16) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(blocks * BLOCK)]


@pytest.fixture(scope="module")
def four_workers(etcd: Etcd) -> Iterator[tuple[ServiceMesh, list[str]]]:
    with ServiceMesh(etcd.endpoint, router_mode="kv") as mesh:
        _, ids = mesh.worker("--num-workers", "4")
        assert wait_until(lambda: mesh.complete().status_code == 200, 20)
        yield mesh, ids


def test_requests_sharing_a_prefix_stick_to_the_worker_that_caches_it(four_workers) -> None:  # noqa: ANN001
    mesh, ids = four_workers
    homes = {}
    for p in range(4):
        shared = prefix(100 + p)
        first = mesh.complete(shared + [1, 2, 3])
        assert first.status_code == 200
        home = first.headers["x-kvmesh-worker"]
        assert wait_until(lambda shared=shared, home=home: mesh.find_matches(shared).get(home) == 16, 5)
        for suffix in range(5):
            r = mesh.complete(shared + [50 + suffix, 7])
            assert r.headers["x-kvmesh-worker"] == home
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * BLOCK
        homes[p] = home
    assert set(homes.values()) <= set(ids)


def test_new_prefixes_spread_over_the_workers(etcd: Etcd) -> None:
    mesh = ServiceMesh(etcd.endpoint, router_mode="kv")
    try:
        _, ids = mesh.worker("--num-workers", "4")
        assert wait_until(lambda: mesh.complete().status_code == 200, 20)
        chosen = Counter(mesh.complete(prefix(500 + p, blocks=4), max_tokens=1).headers["x-kvmesh-worker"]
                         for p in range(16))
    finally:
        mesh.stop()
    # No cached prefix anywhere: load, then the emptiest cache, then chance decide.
    assert set(chosen) == set(ids)
    assert max(chosen.values()) <= 6, chosen


def test_find_matches_reports_each_workers_cached_prefix(four_workers) -> None:  # noqa: ANN001
    mesh, _ = four_workers
    shared = prefix(900, blocks=8)
    home = mesh.complete(shared + [3]).headers["x-kvmesh-worker"]
    assert wait_until(lambda: mesh.find_matches(shared) == {home: 8}, 5), mesh.find_matches(shared)
    assert mesh.find_matches(shared[: 4 * BLOCK]) == {home: 4}
    assert mesh.find_matches(shared[: BLOCK - 1]) == {}  # a partial block is never hashed


@pytest.fixture
def two_processes(etcd: Etcd) -> Iterator[ServiceMesh]:
    mesh = ServiceMesh(etcd.endpoint, router_mode="kv")
    yield mesh
    mesh.stop()


def test_a_killed_worker_loses_its_blocks_in_the_router(two_processes: ServiceMesh) -> None:
    mesh = two_processes
    procs = {}
    for _ in range(2):
        proc, (wid,) = mesh.worker()
        procs[wid] = proc
    assert wait_until(lambda: len(registered(mesh.etcd, mesh.namespace, DECODE_WORKER)) == 2, 10)
    shared = prefix(7)
    home = mesh.complete(shared).headers["x-kvmesh-worker"]
    assert wait_until(lambda: mesh.find_matches(shared) == {home: 16}, 5)

    procs[home].kill()
    assert wait_until(lambda: mesh.find_matches(shared) == {}, LEASE_TTL_S + 5)
    (survivor,) = set(procs) - {home}
    r = mesh.complete(shared)
    assert r.status_code == 200 and r.headers["x-kvmesh-worker"] == survivor


def test_a_restarted_router_rebuilds_its_index_from_the_workers(two_processes: ServiceMesh) -> None:
    mesh = two_processes
    # One worker replays from its buffer; the other keeps so few events that it must send a snapshot.
    mesh.worker()
    mesh.worker("--kv-event-buffer", "2")
    assert wait_until(lambda: len(registered(mesh.etcd, mesh.namespace, DECODE_WORKER)) == 2, 10)
    prompts = [prefix(300 + i, blocks=6) for i in range(8)]
    for p in prompts:
        assert mesh.complete(p).status_code == 200
    assert wait_until(lambda: all(sum(mesh.find_matches(p).values()) == 6 for p in prompts), 5)
    before = [mesh.find_matches(p) for p in prompts]
    assert len({w for scores in before for w in scores}) == 2, "both workers should hold some prefixes"

    mesh.restart_router()
    assert wait_until(lambda: [mesh.find_matches(p) for p in prompts] == before, 10), \
        ([mesh.find_matches(p) for p in prompts], before)
    home = next(iter(before[0]))
    assert mesh.complete(prompts[0] + [9]).headers["x-kvmesh-worker"] == home
