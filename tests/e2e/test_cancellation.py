"""A client that goes away takes its request with it: the decode worker's KV blocks and slot are
freed within a second, and the gateway's in-flight gauge returns to 0."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from testkit.metrics import scrape, total
from tests.procs import MODEL, Etcd, ServiceMesh, wait_until


@pytest.fixture
def slow_mesh(etcd: Etcd) -> Iterator[ServiceMesh]:
    with ServiceMesh(etcd.endpoint) as mesh:
        mesh.worker("--speedup", "0.25")  # 48 ms a token: a 500-token answer would run 24 s
        assert wait_until(lambda: mesh.complete("warm", 1).status_code == 200, 30)
        yield mesh


@pytest.mark.parametrize("streaming", [True, False])
def test_a_client_that_hangs_up_frees_the_workers_kv_and_the_gateway_slot(slow_mesh: ServiceMesh,
                                                                          streaming: bool) -> None:
    body = {"model": MODEL, "prompt": "a long prompt " * 40, "max_tokens": 500, "ignore_eos": True,
            "stream": streaming}
    worker_metrics = lambda: slow_mesh.metrics("decode-worker")  # noqa: E731
    frontend_metrics = lambda: scrape(slow_mesh.url("/metrics"))  # noqa: E731
    with httpx.Client(timeout=60) as client:
        if streaming:
            with client.stream("POST", slow_mesh.url("/v1/completions"), json=body) as r:
                lines = r.iter_lines()
                while not next(lines).startswith("data: {"):
                    pass
                assert total(worker_metrics(), "kvmesh_kv_active_blocks") > 0
        else:
            with pytest.raises(httpx.ReadTimeout):
                client.post(slow_mesh.url("/v1/completions"), content=json.dumps(body),
                            headers={"content-type": "application/json"}, timeout=2)
    # Freed within a second on an idle machine; the deadline leaves room for a loaded one.
    assert wait_until(lambda: total(worker_metrics(), "kvmesh_kv_active_blocks") == 0
                      and total(worker_metrics(), "kvmesh_request_active_slots") == 0, 5, 0.05)
    assert wait_until(lambda: total(frontend_metrics(), "kvmesh_frontend_inflight_requests") == 0, 5, 0.05)
