"""A fresh vLLM worker answers a 2-token prompt sent as its very first request.

On a CPU with AMX tiles such a first request killed the engine (vLLM's attention used AMX before
anything had asked Linux for it; see services/engines/vllm_warmup.py): the worker left etcd and
every request was a 503. The worker now warms its engine up before it registers. On a machine
without AMX the old code passed this test too; the log assertions say the warm-up ran, and ran first.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.procs import MODEL, Etcd, ServiceMesh, registered, service

pytestmark = pytest.mark.vllm


@pytest.fixture
def fresh_mesh(etcd: Etcd) -> Iterator[ServiceMesh]:
    mesh = ServiceMesh(etcd.endpoint)
    yield mesh
    mesh.stop()


def test_a_fresh_vllm_workers_first_request_of_two_tokens_is_answered(fresh_mesh: ServiceMesh) -> None:
    mesh = fresh_mesh
    worker = service("services.decode_worker", "--etcd-endpoints", mesh.etcd, "--namespace", mesh.namespace,
                     "--engine", "vllm", "--drain-timeout", "8", name="decode-worker")
    mesh.procs.append(worker)
    (instance,) = worker.wait_for(r"decode-worker ready: (.+)$", 240).group(1).split()

    first = httpx.post(mesh.url("/v1/completions"), json={"model": MODEL, "prompt": "ab", "max_tokens": 4}, timeout=60)
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["usage"]["prompt_tokens"] == 2, body["usage"]
    assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["finish_reason"] == "length", body
    assert first.headers["x-kvmesh-worker"] == instance

    # The engine lived through it: the worker still serves (1 token now) and is still registered.
    again = httpx.post(mesh.url("/v1/completions"), json={"model": MODEL, "prompt": "a", "max_tokens": 2}, timeout=60)
    assert again.status_code == 200, again.text
    assert [w.instance_id for w in registered(mesh.etcd, mesh.namespace, "decode-worker")] == [instance]
    assert worker.popen.poll() is None

    # The warm-up ran, and before the worker registered.
    lines = list(worker.lines)
    warmed = [i for i, line in enumerate(lines) if "vLLM warm-up: a 64-token prompt, then prompts of 1 and 2" in line]
    ready = [i for i, line in enumerate(lines) if "decode-worker ready: " in line]
    assert warmed and warmed[0] < ready[0], worker.tail()
