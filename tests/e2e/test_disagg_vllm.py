"""Disaggregated serving on real vLLM: remote prefill over NIXL gives exactly the aggregated output."""

from __future__ import annotations

import random
import time

import httpx
import pytest

from testkit.proc_stat import cpu_seconds
from tests.conftest import MAX_LOCAL_PREFILL as MAX_LOCAL
from tests.procs import Mesh, engine_processes

pytestmark = pytest.mark.vllm
MODEL = "kvmesh-demo"


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(20, 1000) for _ in range(n)]


def greedy(mesh: Mesh, prompt: list[int]) -> httpx.Response:
    r = httpx.post(f"{mesh.base_url}/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r


def token_texts(r: httpx.Response) -> list[str]:
    return r.json()["choices"][0]["logprobs"]["tokens"]


@pytest.mark.parametrize("length, where", [
    (40, "local"),            # far below max-local-prefill-length
    (MAX_LOCAL, "local"),     # at the threshold: not above it
    (MAX_LOCAL + 24, "remote"),  # just above
    (1500, "remote"),         # far above
])
def test_greedy_output_equals_aggregated_serving(vllm_mesh: Mesh, vllm_disagg_mesh: Mesh, length: int, where: str) -> None:
    prompt = tokens(length, length)
    aggregated = greedy(vllm_mesh, prompt)
    disaggregated = greedy(vllm_disagg_mesh, prompt)
    assert token_texts(disaggregated) == token_texts(aggregated)
    assert disaggregated.json()["choices"][0]["text"] == aggregated.json()["choices"][0]["text"]
    assert disaggregated.headers["x-kvmesh-prefill"].split(":")[0] == where
    if where == "remote":
        assert len(disaggregated.headers["x-kvmesh-prefill"]) > len("remote:")


def test_a_cached_prefix_makes_a_long_prompt_local_and_keeps_the_output(vllm_mesh: Mesh, vllm_disagg_mesh: Mesh) -> None:
    shared = tokens(7, 600)
    first = greedy(vllm_disagg_mesh, shared + [5, 6])
    assert first.headers["x-kvmesh-prefill"].startswith("remote:")
    # The decode worker now holds the KV of the shared part: only ~40 new tokens to prefill.
    follow = shared + tokens(8, 40)
    cached = greedy(vllm_disagg_mesh, follow)
    assert cached.headers["x-kvmesh-prefill"] == "local"
    assert cached.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 576
    assert token_texts(cached) == token_texts(greedy(vllm_mesh, follow))


def test_idle_engines_with_the_nixl_connector_leave_the_cores_alone(vllm_disagg_mesh: Mesh) -> None:
    """NIXL's progress thread polled with a zero timeout: each idle engine with the connector kept
    a core busy, and a plain vLLM beside this mesh took 400 s instead of 27 s
    (services/engines/vllm_nixl.py). Idle, both workers with their engines use a fraction of one."""
    workers = vllm_disagg_mesh.pids("prefill-worker") + vllm_disagg_mesh.pids("decode-worker")
    assert len(workers) == 2
    pids = [pid for worker in workers for pid in (worker, *engine_processes(worker))]
    before, start = sum(map(cpu_seconds, pids)), time.monotonic()
    time.sleep(3)  # the window the CPU is measured over, not a wait for anything
    used = sum(map(cpu_seconds, pids)) - before
    assert used < 0.5 * (time.monotonic() - start), f"{used:.2f} CPU-s in 3 s by idle engines"
