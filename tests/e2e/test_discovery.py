"""Discovery through etcd: instances come and go under leases, and routing follows."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from collections.abc import Iterator

import httpx
import pytest

from services.mesh.discovery import DECODE_WORKER, ComponentView, InstanceInfo, instance_key
from services.mesh.etcd_lease import LeaseConfig, LeasedRegistration
from services.mesh.etcd_store import EtcdStore
from services.mesh.config_error import EXIT_BAD_FLAGS, EXIT_UNREACHABLE
from tests.procs import ROOT, Etcd, ServiceMesh, free_port, registered, wait_until

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
    # Until the frontend's view has the processor the model is unknown (404); once it has, a request
    # reaches the router, which has no decode worker to offer: 503, saying so.
    replies: list[httpx.Response] = []
    assert wait_until(lambda: replies.append(small_mesh.complete()) or replies[-1].status_code != 404, 15), \
        replies[-1].text
    early = replies[-1]
    assert early.status_code == 503, early.text
    assert early.json()["error"]["code"] == "unavailable"
    assert "no decode worker" in early.json()["error"]["message"], early.text

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


async def test_a_lost_lease_is_registered_again_while_watchers_keep_the_member(etcd: Etcd) -> None:
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
        heard: list[tuple[str, bool]] = []
        view.add_listener(lambda instance_id, info: heard.append((instance_id, info is not None)))
        # An etcd-side loss of the lease (as after a long partition) deletes the key; the view
        # keeps its last member meanwhile, and the registration notices at its next refresh and
        # puts the key back under a new lease.
        await store.revoke_lease(first_lease)
        for _ in range(100):
            if registration.registrations == 2 and await store.get(instance_key(namespace, info)) is not None:
                break
            assert "w1" in view.instances
            await asyncio.sleep(0.1)
        assert registration.registrations == 2 and registration.lease_id != first_lease
        assert "w1" in view.instances and not view._leaving
        # Listeners heard it join once and never leave.
        assert heard == [("w1", True)]
        assert view.instances["w1"] == info
    finally:
        await registration.stop(farewell={instance_key(namespace, info): replace(info, leaving=True).to_json()})
        assert await view.wait_for(lambda i: "w1" not in i, 5), "a deliberate exit leaves the view at once"
        await view.stop()
        await store.close()


def run_to_exit(*argv: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Runs a service to its exit, keeping stdout and stderr apart."""
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))


@pytest.mark.parametrize("module", ["services.kv_router", "services.processor", "services.frontend",
                                    "services.decode_worker", "services.prefill_worker"])
def test_an_unreachable_etcd_exits_3_with_one_error_line_naming_the_endpoint(module: str) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"
    args = ["--etcd-endpoints", endpoint]
    if module in ("services.decode_worker", "services.prefill_worker"):
        args += ["--engine", "mocker"]
    if module == "services.frontend":
        args += ["--http-port", str(free_port())]
    # The processor loads its tokenizer (transformers) before it dials etcd.
    result = run_to_exit(module, *args, timeout_s=120)
    assert result.returncode == EXIT_UNREACHABLE, (result.returncode, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: etcd unreachable at {endpoint}: "), lines[0]
    assert result.stdout == ""


@pytest.mark.parametrize("argv, reason", [
    pytest.param(["services.kv_router", "--router-mode", "fastest"], "argument --router-mode: invalid choice: 'fastest'",
                 id="router-mode"),
    pytest.param(["services.decode_worker", "--engine", "tensorrt"], "argument --engine: invalid choice: 'tensorrt'",
                 id="engine"),
    pytest.param(["services.frontend", "--etcd-endpoints", "localhost"], "--etcd-endpoints: 'localhost' is not a URL",
                 id="etcd-endpoints"),
    pytest.param(["services.launch", "--decode-workers", "0"], "argument --decode-workers: must be > 0, got 0",
                 id="decode-workers"),
    pytest.param(["services.processor", "--no-such-flag"], "unrecognized arguments: --no-such-flag", id="unknown-flag"),
])
def test_bad_flags_exit_2_with_one_error_line_naming_the_flag(argv: list[str], reason: str) -> None:
    result = run_to_exit(*argv, timeout_s=60)
    assert result.returncode == EXIT_BAD_FLAGS, (result.returncode, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and reason in lines[0], lines[0]
    assert result.stdout == ""
