"""The host-memory KV tier on real processes: a prompt pushed into host memory is loaded back on
the worker that holds it, dropped host blocks leave the router's index, and vLLM's tiers.
tests/unit/test_kv_tiers_rules.py has the rules in-process."""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from services.kv_protocol.events import KvEventData, KvRemoved, KvStored
from services.kv_protocol.tier import Tier
from services.mesh.discovery import DECODE_WORKER
from testkit.metrics import metrics_url, scrape, value
from tests.procs import MODEL, ROOT, Etcd, ServiceMesh, find_matches_by_tier, registered, wait_until

# -- on a mesh ------------------------------------------------------------------------------------

DEVICE_BLOCKS = 48  # three 512-token prompts do not fit: the first moves to host memory
PROMPT_BLOCKS = 32


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(PROMPT_BLOCKS * 16)]


def complete(mesh: ServiceMesh, tokens: list[int]) -> httpx.Response:
    r = httpx.post(mesh.url("/v1/completions"), headers={"x-kvmesh-explain": "1"},
                   json={"model": MODEL, "prompt": tokens, "max_tokens": 3}, timeout=30)
    assert r.status_code == 200, r.text
    return r


def cached(r: httpx.Response) -> int:
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def host_hits(mesh: ServiceMesh, worker_id: str) -> float:
    """`kvmesh_worker_host_hits_total` of one worker, from its own process's metrics."""
    (info,) = [i for i in registered(mesh.etcd, mesh.namespace, DECODE_WORKER) if i.instance_id == worker_id]
    return value(scrape(metrics_url(info.metrics_port)), "kvmesh_worker_host_hits_total", worker_id=worker_id)


@pytest.fixture
def tiered_mesh(etcd: Etcd) -> Iterator[ServiceMesh]:
    mesh = ServiceMesh(etcd.endpoint, frontend_flags=("--allow-explain",))
    yield mesh
    mesh.stop()


def test_a_prompt_pushed_into_host_memory_is_loaded_back_on_the_worker_that_holds_it(tiered_mesh: ServiceMesh) -> None:
    mesh = tiered_mesh
    _, (holder,) = mesh.worker("--num-gpu-blocks", str(DEVICE_BLOCKS), "--host-kv-blocks", "256")
    first = prompt(1)
    assert cached(complete(mesh, first + [5])) == 0
    complete(mesh, prompt(2) + [5])
    complete(mesh, prompt(3) + [5])
    assert wait_until(lambda: find_matches_by_tier(mesh.etcd, mesh.namespace, first)
                      == ({}, {holder: PROMPT_BLOCKS}), 5), find_matches_by_tier(mesh.etcd, mesh.namespace, first)
    # An idle worker that holds nothing joins: the one holding the prompt in host memory still wins.
    _, (idle,) = mesh.worker("--num-gpu-blocks", str(DEVICE_BLOCKS), "--host-kv-blocks", "256")
    fresh = random.Random(5)
    assert wait_until(lambda: complete(mesh, [fresh.randrange(10, 1000) for _ in range(40)])
                      .headers["x-kvmesh-worker"] == idle, 10)
    again = complete(mesh, first + [6])
    assert again.headers["x-kvmesh-worker"] == holder, again.headers.get("x-kvmesh-route")
    assert f"host={PROMPT_BLOCKS} credit=" in again.headers["x-kvmesh-route"]
    assert cached(again) == PROMPT_BLOCKS * 16  # both tiers count as cached
    assert host_hits(mesh, holder) == PROMPT_BLOCKS
    # Loaded back: on the device now, in one tier only.
    assert wait_until(lambda: find_matches_by_tier(mesh.etcd, mesh.namespace, first)
                      == ({holder: PROMPT_BLOCKS}, {}), 5)


def test_blocks_the_host_tier_drops_leave_the_index(tiered_mesh: ServiceMesh) -> None:
    mesh = tiered_mesh
    _, (worker,) = mesh.worker("--num-gpu-blocks", str(DEVICE_BLOCKS), "--host-kv-blocks", "40")
    first = prompt(11)
    for seed in (11, 12, 13):
        complete(mesh, prompt(seed) + [5])

    def host_held() -> int:
        device, host = find_matches_by_tier(mesh.etcd, mesh.namespace, first)
        return device.get(worker, 0) + host.get(worker, 0)

    # 40 host blocks cannot keep all of the first prompt once the second moves there too.
    assert wait_until(lambda: 0 < host_held() < PROMPT_BLOCKS, 5), host_held()
    held = host_held()
    # What the router believes the worker holds is what the worker reuses.
    assert cached(complete(mesh, first + [6])) == held * 16


# -- vLLM ---------------------------------------------------------------------------------------

def test_vllms_medium_becomes_the_tier_and_other_media_are_not_tracked() -> None:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from services.engines.vllm_kv_events import convert

    tokens = list(range(10, 42))

    def stored(medium: str | None) -> KvEventData | None:
        return convert(BlockStored(block_hashes=[7, 8], parent_block_hash=None, token_ids=tokens, block_size=16,
                                   lora_id=None, medium=medium, lora_name=None))

    assert isinstance(offloaded := stored("CPU"), KvStored) and offloaded.tier == Tier.HOST
    assert isinstance(on_gpu := stored("GPU"), KvStored) and on_gpu.tier == Tier.DEVICE
    assert isinstance(unsaid := stored(None), KvStored) and unsaid.tier == Tier.DEVICE
    assert stored("STORAGE") is None
    assert convert(BlockRemoved(block_hashes=[7], medium="CPU")) == KvRemoved((7,), Tier.HOST)


def test_a_vllm_worker_asked_for_a_host_tier_on_a_cpu_only_machine_exits_with_one_line() -> None:
    from services.engines.vllm_engine import on_cpu

    if not on_cpu():
        pytest.skip("this machine has a GPU: vLLM's host offloading may work here")
    done = subprocess.run([sys.executable, "-m", "services.decode_worker", "--engine", "vllm", "--host-kv-blocks", "64",
                           "--check-config"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: --host-kv-blocks: vLLM on a CPU-only machine keeps its KV cache in host memory already and cannot "
        "offload it; use --engine mocker for a host tier here"]
