"""A processor can die under load: requests not yet routed go to another processor, and a
stream in mid-flight is taken over by another one, so the client sees one uninterrupted stream."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testkit.metrics import metrics_url, scrape, total
from tests.procs import Etcd, ServiceMesh, registered, wait_until
from tests.e2e.test_migration import MAX_TOKENS, SLOW, act_after, stream


@pytest.fixture
def two_processors(etcd: Etcd) -> Iterator[ServiceMesh]:
    with ServiceMesh(etcd.endpoint, processors=2) as mesh:
        mesh.worker(*SLOW)
        assert wait_until(lambda: len(registered(etcd.endpoint, mesh.namespace, "processor")) == 2, 30)
        assert wait_until(lambda: mesh.complete("warm up", 1).status_code == 200, 30)
        yield mesh


def test_a_sigkilled_processor_turns_no_request_away(two_processors: ServiceMesh) -> None:
    two_processors.processors[0].kill()
    # Until its lease expires the dead processor is still registered; each request that picks it
    # goes on to the other one, and the gateway stops picking it at once.
    statuses = [two_processors.complete(f"after the kill {i}", 2).status_code for i in range(8)]
    assert statuses == [200] * 8


def test_a_processor_killed_mid_stream_hands_the_stream_over(two_processors: ServiceMesh) -> None:
    mesh = two_processors
    by_instance = {p.wait_for(r"processor (\w+) for", 5).group(1): p for p in mesh.processors}

    def kill_the_serving_processor(_: object) -> None:
        for info in registered(mesh.etcd, mesh.namespace, "processor"):
            if total(scrape(metrics_url(info.metrics_port), timeout_s=5), "kvmesh_processor_inflight_requests") > 0:
                by_instance[info.instance_id].kill()
                return
        raise AssertionError("no processor reports the stream in flight")

    broken = stream(mesh, "hand me over", act_after(10, kill_the_serving_processor))
    assert broken.error is None, broken.error
    assert broken.finish == "length" and broken.completion_tokens == MAX_TOKENS
    assert sum(p.popen.poll() is not None for p in mesh.processors) == 1
    unbroken = stream(mesh, "hand me over")
    assert "".join(broken.text) == "".join(unbroken.text)

