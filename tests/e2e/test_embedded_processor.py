"""A gateway hosting its processor (`--embed-processor`, the launcher's `--embed-processors`):
no processor process, the gateway's requests served in-process, the processor still registered
and reachable over gRPC like any, and a drain that lets a running stream finish (real processes).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import httpx
import pytest

from services.mesh.discovery import PROCESSOR
from testkit.metrics import metrics_url, total
from testkit.sse import MODEL, Streamed, completion_body, stream_sync
from testkit.proc import Proc
from tests.procs import Etcd, ServiceMesh, registered, wait_until


def gateway(mesh: ServiceMesh) -> Proc:
    (frontend,) = [p for p in mesh.procs if p.name == "frontend"]
    return frontend


@pytest.fixture(scope="module")
def hosted(etcd: Etcd) -> Iterator[ServiceMesh]:
    with ServiceMesh(etcd.endpoint, processors=0, frontend_flags=("--embed-processor", "--routing", "local")) as mesh:
        mesh.worker()
        assert wait_until(lambda: mesh.complete().status_code == 200, 30)
        yield mesh


def test_the_gateway_serves_every_request_through_the_processor_it_hosts(hosted: ServiceMesh) -> None:
    (processor,) = registered(hosted.etcd, hosted.namespace, PROCESSOR)
    frontend = gateway(hosted)
    assert [p.name for p in hosted.procs if p.name.startswith("processor")] == []
    assert processor.model == MODEL
    for _ in range(3):
        r = hosted.complete("The router keeps a tree", max_tokens=4)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 30,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    streamed = stream_sync(hosted.url("/v1/chat/completions"), chat)
    assert streamed.status == 200 and streamed.done, streamed.broken or streamed.body
    assert streamed.usage is not None and streamed.usage.completion_tokens == 30
    # Count tokens asks a processor over gRPC: the hosted one answers on its registered address.
    counted = httpx.post(hosted.url("/v1/messages/count_tokens"), timeout=30,
                         json={"model": MODEL, "messages": [{"role": "user", "content": "hello there"}]})
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0, counted.text
    # The streamed tokens came without a frame: the processor's session hub wrote none to the
    # gateway, so its hop was never measured; the gateway's own hop counts from the decode
    # worker's frames instead (the processor's work and its own).
    processor_metrics = httpx.get(metrics_url(processor.metrics_port), timeout=10).text
    assert total(processor_metrics, "kvmesh_hop_latency_seconds_count", hop="processor") == 0
    gateway_metrics = hosted.metrics("frontend")
    assert total(gateway_metrics, "kvmesh_hop_latency_seconds_count", hop="frontend") > 0
    assert total(gateway_metrics, "kvmesh_frontend_completion_tokens_total") >= 42
    assert frontend.alive


def test_a_drained_gateway_lets_its_running_stream_finish_then_exits(etcd: Etcd) -> None:
    with ServiceMesh(etcd.endpoint, processors=0, frontend_flags=("--embed-processor",)) as mesh:
        mesh.worker()
        assert wait_until(lambda: mesh.complete().status_code == 200, 30)
        frontend = gateway(mesh)
        signalled: list[int] = []

        def drain_once(so_far: Streamed) -> None:
            if not signalled:
                signalled.append(len(so_far.arrivals))
                frontend.popen.send_signal(signal.SIGTERM)  # a drain, mid-stream

        # The mocker at --speedup 20: 60 tokens take long enough to be mid-stream at the drain.
        streamed = stream_sync(mesh.url("/v1/completions"), completion_body("a long answer", 60), on_chunk=drain_once)
        assert signalled, "the stream had a first chunk"
        assert streamed.status == 200 and streamed.done, streamed.broken or streamed.body
        assert streamed.usage is not None and streamed.usage.completion_tokens == 60
        assert frontend.stop() == 0, frontend.tail()
        assert not registered(mesh.etcd, mesh.namespace, PROCESSOR), "the hosted processor left etcd too"
