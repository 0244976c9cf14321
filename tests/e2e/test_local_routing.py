"""`--routing local`: the processor routes with its own index of the decode pool, fed by the
workers' KV event and load streams, and asks the kv-router service nothing (real processes)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from services.mesh.discovery import DECODE_WORKER, PROCESSOR, ROUTER
from tests.procs import Etcd, ServiceMesh, registered, wait_until
from tests.e2e.test_kv_routing import BLOCK, prefix


def routed(metrics: str) -> float:
    """Requests routed to decode workers, per the metrics text of one process."""
    return sum(float(m.group(1)) for m in re.finditer(
        r'^kvmesh_router_routed_requests_total\{[^}]*role="decode-worker"[^}]*\} (\S+)$', metrics, re.M))


@pytest.fixture(scope="module")
def local_mesh(etcd: Etcd) -> Iterator[tuple[ServiceMesh, list[str]]]:
    mesh = ServiceMesh(etcd.endpoint, router_mode="kv", processor_flags=("--routing", "local"))
    _, ids = mesh.worker("--num-workers", "4")
    assert wait_until(lambda: mesh.complete().status_code == 200, 20)
    yield mesh, ids
    mesh.stop()


def test_a_processor_routing_locally_keeps_prefixes_on_the_worker_that_caches_them(local_mesh) -> None:  # noqa: ANN001
    mesh, ids = local_mesh
    assert len(registered(mesh.etcd, mesh.namespace, DECODE_WORKER)) == 4
    for p in range(3):
        shared = prefix(700 + p)
        home = mesh.complete(shared + [1, 2, 3]).headers["x-kvmesh-worker"]
        assert home in ids
        # The processor's own index learns the worker's blocks from its KV event stream.
        assert wait_until(lambda shared=shared, home=home: mesh.find_matches(shared).get(home) == 16, 5)
        for suffix in range(4):
            r = mesh.complete(shared + [60 + suffix, 9])
            assert r.status_code == 200
            assert r.headers["x-kvmesh-worker"] == home
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * BLOCK


def test_the_router_service_is_not_asked_and_the_processor_counts_its_decisions(local_mesh) -> None:  # noqa: ANN001
    mesh, _ = local_mesh
    before = routed(mesh.metrics(PROCESSOR))
    for i in range(5):
        assert mesh.complete(f"{i} a fresh prompt").status_code == 200
    assert routed(mesh.metrics(PROCESSOR)) >= before + 5
    assert routed(mesh.metrics(ROUTER)) == 0
