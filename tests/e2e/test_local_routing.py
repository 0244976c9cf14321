"""`--routing local`: the processor routes with its own index of the decode pool, fed by the
workers' KV event and load streams, and asks the kv-router service nothing (real processes)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.mesh.discovery import DECODE_WORKER, PROCESSOR, ROUTER
from testkit.metrics import total
from tests.procs import Etcd, ServiceMesh, registered, wait_until
from tests.e2e.test_kv_routing import BLOCK, prefix
from tests.e2e.test_route_explanation import parse_route

EXPLAIN = {"x-kvmesh-explain": "1"}


def routed(metrics: str) -> float:
    """Requests routed to decode workers, per the metrics text of one process."""
    return total(metrics, "kvmesh_router_routed_requests_total", role="decode-worker")


def overlap_seen(mesh: ServiceMesh, prompt: list[int], worker: str) -> int | None:
    """The blocks of `prompt` the processor's own index says `worker` caches, from its explanation
    of routing `prompt` (None when the worker is neither the chosen one nor the runner-up)."""
    r = mesh.complete(prompt, max_tokens=1, headers=EXPLAIN)
    assert r.status_code == 200, r.text
    terms = parse_route(r.headers["x-kvmesh-route"])
    return next((int(t["overlap"]) for t in terms.values() if worker in (t.get("chosen"), t.get("runner-up"))), None)


@pytest.fixture(scope="module")
def local_mesh(etcd: Etcd) -> Iterator[tuple[ServiceMesh, list[str]]]:
    # --allow-explain: the x-kvmesh-route header shows what the processor's own index holds.
    with ServiceMesh(etcd.endpoint, router_mode="kv", processor_flags=("--routing", "local"),
                     frontend_flags=("--allow-explain",)) as mesh:
        _, ids = mesh.worker("--num-workers", "4")
        assert wait_until(lambda: mesh.complete().status_code == 200, 20)
        yield mesh, ids


def test_a_processor_routing_locally_keeps_prefixes_on_the_worker_that_caches_them(local_mesh) -> None:  # noqa: ANN001
    mesh, ids = local_mesh
    assert len(registered(mesh.etcd, mesh.namespace, DECODE_WORKER)) == 4
    for p in range(3):
        shared = prefix(700 + p)
        home = mesh.complete(shared + [1, 2, 3]).headers["x-kvmesh-worker"]
        assert home in ids
        # The processor's own index learns the worker's blocks from its KV event stream. Asked
        # about the first block alone: a probe routed before the index learned it leaves one
        # block elsewhere, which cannot outweigh the sixteen the home worker holds.
        assert wait_until(lambda shared=shared, home=home: overlap_seen(mesh, shared[:BLOCK], home) == 1, 5)
        for suffix in range(4):
            r = mesh.complete(shared + [60 + suffix, 9], headers=EXPLAIN)
            assert r.status_code == 200
            assert r.headers["x-kvmesh-worker"] == home
            route = parse_route(r.headers["x-kvmesh-route"])["chosen"]
            assert (route["chosen"], route["overlap"]) == (home, "16"), r.headers["x-kvmesh-route"]
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * BLOCK


def test_the_router_service_is_not_asked_and_the_processor_counts_its_decisions(local_mesh) -> None:  # noqa: ANN001
    mesh, _ = local_mesh
    before = routed(mesh.metrics(PROCESSOR))
    for i in range(5):
        assert mesh.complete(f"{i} a fresh prompt").status_code == 200
    assert routed(mesh.metrics(PROCESSOR)) >= before + 5
    assert routed(mesh.metrics(ROUTER)) == 0
