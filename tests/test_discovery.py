"""Discovery through etcd: instances come and go under leases, and routing follows."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from services.mesh.discovery import DECODE_WORKER, ComponentView, InstanceInfo, instance_key
from services.mesh.etcd_lease import LeaseConfig, LeasedRegistration
from services.mesh.etcd_store import EtcdStore
from tests.procs import Etcd, ServiceMesh, free_port, registered, service, wait_until

MODEL = "kvmesh-demo"
LEASE_TTL_S = 10


@pytest.fixture
def small_mesh(etcd: Etcd) -> Iterator[ServiceMesh]:
    mesh = ServiceMesh(etcd.endpoint, router_mode="round-robin")
    yield mesh
    mesh.stop()


def test_a_worker_started_after_the_frontend_becomes_usable(small_mesh: ServiceMesh) -> None:
    health = httpx.get(small_mesh.url("/health"), timeout=10)
    assert health.status_code == 503
    assert "decode worker" in health.json()["reason"]
    early = httpx.post(small_mesh.url("/v1/completions"), json={"model": MODEL, "prompt": "x"}, timeout=30)
    assert early.status_code in (404, 503)

    _, (worker_id,) = small_mesh.worker()
    assert wait_until(lambda: httpx.get(small_mesh.url("/health"), timeout=10).status_code == 200, 15)
    r = small_mesh.complete()
    assert r.status_code == 200, r.text
    assert r.headers["x-kvmesh-worker"] == worker_id


def test_a_sigkilled_worker_leaves_routing_within_the_lease_ttl(small_mesh: ServiceMesh) -> None:
    _, (survivor,) = small_mesh.worker()
    victim_proc, (victim,) = small_mesh.worker()
    assert wait_until(lambda: {small_mesh.complete().headers.get("x-kvmesh-worker") for _ in range(4)} == {survivor, victim}, 15)

    victim_proc.kill()
    killed_at = time.monotonic()
    # Requests keep succeeding meanwhile: one routed to the dead worker is retried on another.
    statuses = []

    def only_survivor_left() -> bool:
        r = small_mesh.complete()
        statuses.append(r.status_code)
        return r.status_code == 200 and victim not in _registered_workers(small_mesh)

    assert wait_until(only_survivor_left, LEASE_TTL_S + 5)
    assert time.monotonic() - killed_at <= LEASE_TTL_S + 5
    assert set(statuses) == {200}
    workers = {small_mesh.complete().headers["x-kvmesh-worker"] for _ in range(6)}
    assert workers == {survivor}


def _registered_workers(mesh: ServiceMesh) -> set[str]:
    return {i.instance_id for i in registered(mesh.etcd, mesh.namespace, DECODE_WORKER)}


async def test_a_lost_lease_is_registered_again_and_watchers_see_it(etcd: Etcd) -> None:
    namespace = f"lease-{uuid.uuid4().hex[:8]}"
    store = EtcdStore((etcd.endpoint,))
    await store.connect()
    view = ComponentView(store, namespace, DECODE_WORKER)
    await view.start()
    info = InstanceInfo(component=DECODE_WORKER, instance_id="w1", address="127.0.0.1:1", model=MODEL, block_size=16)
    registration = LeasedRegistration(store, LeaseConfig(ttl_s=3))
    try:
        first_lease = await registration.start({instance_key(namespace, info): info.to_json()})
        assert await view.wait_for(lambda i: "w1" in i, 5)
        # An etcd-side loss of the lease (as after a long partition) deletes the key...
        await store.revoke_lease(first_lease)
        assert await view.wait_for(lambda i: "w1" not in i, 5)
        # ...and the registration notices at its next refresh and puts it back under a new lease.
        assert await view.wait_for(lambda i: "w1" in i, 5)
        for _ in range(50):  # the watch can report the put before the registration task resumes
            if registration.registrations == 2:
                break
            await asyncio.sleep(0.1)
        assert registration.registrations == 2 and registration.lease_id != first_lease
        assert view.instances["w1"] == info
    finally:
        await registration.stop()
        assert await view.wait_for(lambda i: "w1" not in i, 5), "stop() revokes the lease at once"
        await view.stop()
        await store.close()


@pytest.mark.parametrize("module", ["services.kv_router", "services.processor", "services.frontend", "services.decode_worker"])
def test_an_unreachable_etcd_exits_non_zero_with_one_line(module: str) -> None:
    args = ["--etcd-endpoints", f"http://127.0.0.1:{free_port()}"]
    if module == "services.decode_worker":
        args += ["--engine", "mocker"]
    if module == "services.frontend":
        args += ["--http-port", str(free_port())]
    proc = service(module, *args)
    code = proc.popen.wait(120)  # the processor loads its tokenizer (transformers) before etcd
    proc.stop()
    assert code != 0
    errors = [line for line in proc.lines if line.startswith("error:")]
    assert len(errors) == 1 and "etcd unreachable" in errors[0], proc.tail()


@pytest.mark.parametrize("argv", [
    ["services.kv_router", "--router-mode", "fastest"],
    ["services.decode_worker", "--engine", "tensorrt"],
    ["services.frontend", "--etcd-endpoints", "localhost"],
    ["services.launch", "--decode-workers", "0"],
])
def test_bad_flags_exit_non_zero_with_a_reason(argv: list[str]) -> None:
    proc = service(*argv)
    code = proc.popen.wait(60)
    proc.stop()
    assert code == 2
    assert any("error" in line for line in proc.lines), proc.tail()
