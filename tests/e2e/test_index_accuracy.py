"""The router's index accuracy on a real mocker mesh: the processor reports what the engine found
cached of each routed prompt, and the router's metrics compare it with what it predicted
(services/routing/index_accuracy.py); the x-kvmesh-route header tells each worker's kv_source
and recent accuracy.

One decode worker, so every request goes to it. Each request's own numbers are read from its
response: the prediction from the explanation (`overlap` blocks of 16 tokens; the mocker reuses
every full block, so no cap below the prompt's length) and the engine's count from the usage's
cached_tokens.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from services.mesh.discovery import PROCESSOR, ROUTER
from tests.e2e.test_kv_routing import BLOCK
from testkit.metrics import parse
from tests.e2e.test_route_explanation import parse_route
from tests.procs import MODEL, Etcd, ServiceMesh, wait_until

EXPLAIN = {"x-kvmesh-explain": "1"}


@dataclass(frozen=True)
class Series:
    """One worker's accuracy series, as a metrics endpoint shows them."""

    count: float = 0.0
    ratio_sum: float = 0.0
    error_sum: float = 0.0
    exact: float = 0.0  # requests with no error (the error histogram's le="0.0" bucket)
    recent: float | None = None


def series(text: str, worker: str) -> Series:
    values: dict[str, float] = {}
    for s in parse(text):
        if s.labels.get("worker_id") != worker:
            continue
        if s.name.endswith("_bucket") and s.labels.get("le") != "0.0":
            continue
        values[s.name] = s.value
    return Series(values.get("kvmesh_router_index_accuracy_ratio_count", 0.0),
                  values.get("kvmesh_router_index_accuracy_ratio_sum", 0.0),
                  values.get("kvmesh_router_index_error_tokens_sum", 0.0),
                  values.get("kvmesh_router_index_error_tokens_bucket", 0.0),
                  values.get("kvmesh_router_index_recent_accuracy"))


def settled(mesh: ServiceMesh, component: str, worker: str, count: float) -> Series:
    """The series once `count` requests have reported back (feedback rides on the next call to
    the router, or goes alone within 0.1 s)."""
    assert wait_until(lambda: series(mesh.metrics(component), worker).count >= count, 10)
    return series(mesh.metrics(component), worker)


def prompt(seed: int, blocks: int = 4) -> list[int]:
    """`blocks` full blocks and three tokens more: no cap on what the engine can reuse applies."""
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(blocks * BLOCK + 3)]


@dataclass(frozen=True)
class Answer:
    worker: str
    predicted: int
    cached: int
    route: dict[str, str]

    @property
    def ratio(self) -> float:
        high = max(self.predicted, self.cached)
        return min(self.predicted, self.cached) / high if high else 1.0


def ask(mesh: ServiceMesh, tokens: list[int]) -> Answer:
    r = httpx.post(mesh.url("/v1/completions"), json={"model": MODEL, "prompt": tokens, "max_tokens": 1},
                   headers=EXPLAIN, timeout=30)
    assert r.status_code == 200, r.text
    chosen = parse_route(r.headers["x-kvmesh-route"])["chosen"]
    assert chosen["chosen"] == r.headers["x-kvmesh-worker"]
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == len(tokens)
    return Answer(chosen["chosen"], min(int(chosen["overlap"]) * BLOCK, len(tokens)),
                  usage["prompt_tokens_details"]["cached_tokens"], chosen)


def one_worker_mesh(etcd: Etcd, *processor_flags: str) -> Iterator[tuple[ServiceMesh, str]]:
    with ServiceMesh(etcd.endpoint, router_mode="kv", frontend_flags=("--allow-explain",),
                     processor_flags=processor_flags) as mesh:
        _, (worker,) = mesh.worker()
        assert wait_until(lambda: mesh.complete().status_code == 200, 20)
        yield mesh, worker


@pytest.fixture(scope="module")
def mesh(etcd: Etcd) -> Iterator[tuple[ServiceMesh, str]]:
    yield from one_worker_mesh(etcd)


def test_a_prompt_sent_again_is_predicted_exactly(mesh: tuple[ServiceMesh, str]) -> None:
    m, worker = mesh
    before = settled(m, ROUTER, worker, 1)  # the mesh's warm-up request
    tokens = prompt(1)
    first = ask(m, tokens)
    # New to the worker: nothing predicted, nothing found.
    assert (first.worker, first.predicted, first.cached) == (worker, 0, 0)
    assert first.route["kv_source"] == "events"
    after_first = settled(m, ROUTER, worker, before.count + 1)
    assert wait_until(lambda: m.find_matches(tokens).get(worker) == 4, 5)
    second = ask(m, tokens)
    # Four blocks of 16 predicted and found (the three tokens past them fill no block).
    assert (second.predicted, second.cached) == (4 * BLOCK, 4 * BLOCK)
    # The header tells the accuracy as the decision saw it: with the first request's sample.
    assert after_first.recent is not None
    assert (second.route["kv_source"], second.route["accuracy"]) == ("events", f"{after_first.recent:.3f}")
    after = settled(m, ROUTER, worker, before.count + 2)
    assert after.count - before.count == 2
    assert after.ratio_sum - before.ratio_sum == pytest.approx(2.0)
    assert (after.error_sum - before.error_sum, after.exact - before.exact) == (0, 2)


def test_a_prompt_found_cached_that_the_index_did_not_know_counts_as_such(mesh: tuple[ServiceMesh, str]) -> None:
    """Identical prompts sent at once: those routed before the worker's KV events of the first
    reached the router were predicted nothing, yet the engine found the first one's blocks. Each
    request's sample is computed from its own response; bursts are sent until one differs."""
    m, worker = mesh
    differed = False
    for burst in range(10):
        before = settled(m, ROUTER, worker, 1)
        tokens = prompt(100 + burst, blocks=8)
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda t: ask(m, t), [tokens] * 6))
        after = settled(m, ROUTER, worker, before.count + len(answers))
        assert after.count - before.count == len(answers)
        assert after.ratio_sum - before.ratio_sum == pytest.approx(sum(a.ratio for a in answers))
        assert after.error_sum - before.error_sum == sum(abs(a.predicted - a.cached) for a in answers)
        if any(a.predicted != a.cached for a in answers):
            differed = True
            assert after.recent is not None and after.recent < 1.0
            break
    assert differed, "no burst had a request routed before the router knew the first one's blocks"


@pytest.fixture(scope="module")
def local_mesh(etcd: Etcd) -> Iterator[tuple[ServiceMesh, str]]:
    yield from one_worker_mesh(etcd, "--routing", "local")


def test_a_processor_routing_locally_measures_its_own_index(local_mesh: tuple[ServiceMesh, str]) -> None:
    m, worker = local_mesh
    before = settled(m, PROCESSOR, worker, 1)
    tokens = prompt(7)
    assert ask(m, tokens).cached == 0
    assert wait_until(lambda: ask(m, tokens[:BLOCK] + [5]).predicted == BLOCK, 5)  # the index learned it
    mid = settled(m, PROCESSOR, worker, before.count + 2)
    again = ask(m, tokens)
    assert (again.predicted, again.cached) == (4 * BLOCK, 4 * BLOCK)
    assert again.route["accuracy"] == f"{mid.recent:.3f}"
    after = settled(m, PROCESSOR, worker, mid.count + 1)
    assert after.ratio_sum - mid.ratio_sum == pytest.approx(1.0) and after.exact - mid.exact == 1
