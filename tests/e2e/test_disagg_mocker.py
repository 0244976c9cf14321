"""Disaggregation on the mocker: real NIXL transfers between processes, metadata under leases,
and no request lost when the prefill pool fails."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
from collections.abc import Iterator

import grpc
import httpx
import pytest
from prometheus_client.samples import Sample

from gen.kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.mesh.discovery import DECODE_WORKER, PREFILL_WORKER, ROUTER
from services.engines.base import EngineBusy
from services.engines.mocker.kv_transfer import KvTransferError, NixlKvEndpoint, nixl_metadata_key
from testkit.metrics import metrics_url, scrape, total
from tests.procs import MODEL, Etcd, ServiceMesh, registered, wait_until

BYTES_PER_TOKEN = 2048
LEASE_TTL_S = 10
NIXL = ("--kv-transfer", "nixl", "--kv-bytes-per-token", str(BYTES_PER_TOKEN))
# Prompts with more uncached tokens than this prefill remotely.
MAX_LOCAL_PREFILL = 256
# A prefill worker this slow takes ~28 s for a 2000-token prompt (~7 ms at the usual --speedup 20):
# a prompt on it stays in flight long enough to be seen there on any machine.
SLOW_PREFILL_SPEEDUP = 0.005


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(20, 1000) for _ in range(n)]


def etcd_has(etcd: str, key: str) -> bool:
    from services.mesh.etcd_store import EtcdStore

    async def check() -> bool:
        store = EtcdStore((etcd,))
        await store.connect()
        try:
            return await store.get(key) is not None
        finally:
            await store.close()

    return asyncio.run(check())


def disagg_mesh(etcd: Etcd, prefill_timeout_s: float, *prefill_extra: str) -> ServiceMesh:
    """One decode worker (remote prefill above MAX_LOCAL_PREFILL tokens) and one prefill worker."""
    mesh = ServiceMesh(etcd.endpoint, router_mode="kv")
    try:
        mesh.worker(*NIXL, "--remote-prefill", "--max-local-prefill-length", str(MAX_LOCAL_PREFILL),
                    "--prefill-timeout", str(prefill_timeout_s), "--max-prefill-queue-size", "64")
        mesh.prefill_worker(*NIXL, *prefill_extra)
        assert wait_until(lambda: router_serves_prefill_pool(mesh), 20), "the router never saw the prefill worker"
    except BaseException:
        mesh.stop()
        raise
    return mesh


# Module-scoped: its tests run in file order, the one that counts what the decode worker did
# first, the one that adds and kills a prefill worker last.
@pytest.fixture(scope="module")
def disagg(etcd: Etcd) -> Iterator[ServiceMesh]:
    mesh = disagg_mesh(etcd, 5)
    yield mesh
    mesh.stop()


@pytest.fixture
def slow_prefill_disagg(etcd: Etcd) -> Iterator[ServiceMesh]:
    """As `disagg`, with a slow prefill worker and a decode worker that waits for it (no deadline fallback)."""
    mesh = disagg_mesh(etcd, 300, "--speedup", str(SLOW_PREFILL_SPEEDUP))
    yield mesh
    mesh.stop()


def router_serves_prefill_pool(mesh: ServiceMesh) -> bool:
    """Whether the router has a prefill worker for the model (FindMatches names a block size only then)."""
    routers = registered(mesh.etcd, mesh.namespace, ROUTER)
    if not routers:
        return False
    with grpc.insecure_channel(routers[0].address) as channel:
        reply = router_pb2_grpc.RouterStub(channel).FindMatches(
            router_pb2.FindMatchesRequest(model=MODEL, token_ids=tokens(0, 32), role=common_pb2.WORKER_ROLE_PREFILL),
            timeout=10)
    return reply.block_size > 0


def decode_metrics(mesh: ServiceMesh) -> list[Sample]:
    (worker,) = registered(mesh.etcd, mesh.namespace, DECODE_WORKER)
    return scrape(metrics_url(worker.metrics_port))


def test_kv_crosses_processes_over_nixl_intact(disagg: ServiceMesh) -> None:
    prompt = tokens(1, 1000)
    r = disagg.complete(prompt, max_tokens=4)
    assert r.status_code == 200
    assert r.headers["x-kvmesh-prefill"].startswith("remote:")
    samples = decode_metrics(disagg)
    # Every byte arrived, and the checksum check (a mismatch would have meant a local fallback) passed.
    assert total(samples, "kvmesh_kv_transfer_bytes_total") == 1000 * BYTES_PER_TOKEN
    assert total(samples, "kvmesh_kv_transfer_duration_seconds_count") == 1
    assert total(samples, "kvmesh_decode_remote_prefill_total") == 1
    assert total(samples, "kvmesh_decode_prefill_fallback_total") == 0
    short = disagg.complete(tokens(2, 100), max_tokens=2)
    assert short.headers["x-kvmesh-prefill"] == "local"


def test_the_same_prompt_gives_the_same_answer_remote_or_local(disagg: ServiceMesh) -> None:
    prompt = tokens(3, 800)
    remote = disagg.complete(prompt, max_tokens=16)
    local = disagg.complete(prompt, max_tokens=16)  # now cached on the decode worker
    assert remote.headers["x-kvmesh-prefill"].startswith("remote:") and local.headers["x-kvmesh-prefill"] == "local"
    assert remote.json()["choices"][0]["text"] == local.json()["choices"][0]["text"]


def test_nixl_metadata_lives_in_etcd_under_the_prefill_workers_lease(disagg: ServiceMesh) -> None:
    proc, (prefill_id,) = disagg.prefill_worker("--kv-transfer", "nixl")
    key = nixl_metadata_key(disagg.namespace, prefill_id)
    assert etcd_has(disagg.etcd, key)
    proc.kill()
    assert wait_until(lambda: not etcd_has(disagg.etcd, key), LEASE_TTL_S + 5)


def complete(mesh: ServiceMesh, prompt: list[int]) -> httpx.Response:
    return httpx.post(mesh.url("/v1/completions"), json={"model": MODEL, "prompt": prompt, "max_tokens": 8},
                      timeout=120)


def prefill_blocks_in_use(metrics_port: int) -> float:
    """KV blocks the prefill worker's engine holds: above 0 only while it computes a prompt."""
    return total(scrape(metrics_url(metrics_port)), "kvmesh_kv_active_blocks", role="prefill")


def test_a_prefill_worker_killed_mid_prefill_loses_no_request(slow_prefill_disagg: ServiceMesh) -> None:
    mesh = slow_prefill_disagg
    prefill_proc = next(p for p in mesh.procs if p.name == "prefill-worker")
    (prefill,) = registered(mesh.etcd, mesh.namespace, PREFILL_WORKER)
    assert prefill_blocks_in_use(prefill.metrics_port) == 0
    caught = tokens(100, 2000)
    replies: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: replies.append(complete(mesh, caught)), daemon=True)
    sender.start()
    try:
        # Provably in flight: the prefill worker's engine holds this prompt's blocks while computing it.
        assert wait_until(lambda: prefill_blocks_in_use(prefill.metrics_port) > 0, 60, 0.05), prefill_proc.tail()
        prefill_proc.kill()
    finally:
        sender.join(150)
    assert not sender.is_alive(), "the request on the killed prefill worker never finished"
    (reply,) = replies
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-kvmesh-prefill"] == "local"
    samples = decode_metrics(mesh)
    # The decode worker's Prefill call broke with the process: one fallback, reason "error".
    assert total(samples, "kvmesh_decode_prefill_fallback_total", reason="error") == 1
    assert total(samples, "kvmesh_decode_prefill_fallback_total") == 1
    assert total(samples, "kvmesh_decode_remote_prefill_total") == 0
    assert total(samples, "kvmesh_decode_local_prefill_total") == 1

    # The stream goes on after the kill: every long prompt still completes, prefilled locally.
    later = [tokens(200 + i, 600 + i) for i in range(4)]
    results = [complete(mesh, p) for p in later]
    assert [r.status_code for r in results] == [200] * len(later), [r.text for r in results if r.status_code != 200]
    assert [r.headers["x-kvmesh-prefill"] for r in results] == ["local"] * len(later)
    samples = decode_metrics(mesh)
    assert total(samples, "kvmesh_decode_prefill_fallback_total") == 1 + len(later)
    # Until its lease expires the dead worker is still chosen (error); after, none is left (no_prefill_worker).
    assert total(samples, "kvmesh_decode_prefill_fallback_total", reason="error") + \
        total(samples, "kvmesh_decode_prefill_fallback_total", reason="no_prefill_worker") == 1 + len(later)
    # Correct answers: the mocker's output depends only on the prompt, so a second run (local, from
    # the decode worker's cache) must match the first.
    for prompt, first in zip([caught, *later], [reply, *results]):
        again = complete(mesh, prompt)
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]


def test_a_client_that_hangs_up_mid_prefill_aborts_the_prefill(slow_prefill_disagg: ServiceMesh) -> None:
    """The decode side's cancelled call cancels the Prefill call, which aborts the prefill engine's
    request and frees its blocks (the prompt would take ~28 s on this slow prefill worker)."""
    mesh = slow_prefill_disagg
    (prefill,) = registered(mesh.etcd, mesh.namespace, PREFILL_WORKER)
    body = json.dumps({"model": MODEL, "prompt": tokens(300, 2000), "max_tokens": 8, "stream": True}).encode()
    # No response starts before the prefill is done, so the client is a bare socket it can drop.
    with socket.create_connection(("127.0.0.1", mesh.port), timeout=10) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                       b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert wait_until(lambda: prefill_blocks_in_use(prefill.metrics_port) > 0, 60, 0.05)
    assert wait_until(lambda: prefill_blocks_in_use(prefill.metrics_port) == 0, 10, 0.1)


async def test_a_corrupted_transfer_is_detected() -> None:
    prefill = NixlKvEndpoint("test-prefill", bytes_per_token=64, arena_bytes=1 << 20)
    decode = NixlKvEndpoint("test-decode", bytes_per_token=64, arena_bytes=1 << 20)
    metadata = prefill.metadata()

    async def lookup(peer: str) -> bytes | None:
        return metadata if peer == "test-prefill" else None

    decode.metadata_lookup = lookup
    prefill.start()
    try:
        params = await prefill.hold("r1", tokens(9, 300))
        nbytes, _ = await decode.pull(params)
        assert nbytes == 300 * 64
        bad = await prefill.hold("r2", tokens(10, 300))
        with pytest.raises(KvTransferError, match="checksum"):
            await decode.pull({**bad, "checksum": bad["checksum"] ^ 1})
        assert await asyncio.wait_for(_released(prefill), 5), "the decode side's notification frees the KV"
    finally:
        await prefill.stop()
        await decode.stop()


async def test_a_prefill_worker_whose_kv_memory_is_full_says_busy_until_some_is_pulled() -> None:
    prefill = NixlKvEndpoint("test-full", bytes_per_token=1024, arena_bytes=400 * 1024)
    try:
        await prefill.hold("r1", tokens(11, 300))
        # EngineBusy ends the prefill NO_CAPACITY: the decode worker prefills locally.
        with pytest.raises(EngineBusy, match="no room to hold 307200 KV bytes"):
            await prefill.hold("r2", tokens(12, 300))
        prefill.release("r1")
        assert (await prefill.hold("r2", tokens(12, 300)))["nbytes"] == 300 * 1024
    finally:
        await prefill.stop()


async def _released(endpoint: NixlKvEndpoint) -> bool:
    while endpoint.held_requests:
        await asyncio.sleep(0.01)
    return True
