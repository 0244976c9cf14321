"""The router's Route and FindMatches decisions, driven in-process on hand-built pools, through
its gRPC servicer (the wire: roles by number, refusals as statuses).

The pools are real `WorkerPool`s over a stand-in for our discovery view (its component name and
listener registration are all a pool uses); workers enter through `WorkerPool.admit`, which
does the pool's bookkeeping without following any worker's streams, or through the view's
listener where a test is about that path. The gRPC context is a stand-in whose `abort` raises,
as grpc.aio's does. No etcd, no process, no socket: each test runs in milliseconds.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import pytest
from prometheus_client import CollectorRegistry

from gen.kvmesh.v1 import common_pb2, router_pb2, worker_pb2
from services.contract.worker_roles import RoleName
from services.routing.config import RouterConfig
from services.routing.cost_function import CostWeights
from services.routing.pickers import PICKERS, ROUTER_MODES, make_picker
from services.routing.router import Router
from services.routing.router_metrics import RouterMetrics
from services.routing.servicer import RouterServicer
from services.routing.worker_pool import MAX_PENDING, PENDING_GRACE_S, WorkerPool
from services.mesh.discovery import DECODE_WORKER, PREFILL_WORKER, InstanceInfo, Listener
from services.kv_protocol.hashing import chained_block_hashes, local_block_hashes

BS = 4
MODEL = "m"
PROMPT = list(range(100, 100 + 4 * BS))  # four full blocks
DECODE, PREFILL = common_pb2.WORKER_ROLE_DECODE, common_pb2.WORKER_ROLE_PREFILL


@dataclass
class FakeView:
    """What a WorkerPool uses of our ComponentView: the component name and its listeners."""

    component: str
    listeners: list[Listener] = field(default_factory=list)

    def add_listener(self, listener: Listener) -> None:
        self.listeners.append(listener)

    def announce(self, instance_id: str, info: InstanceInfo | None) -> None:
        for listener in self.listeners:
            listener(instance_id, info)


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


class AbortingContext:
    """grpc.aio's servicer context as the router uses it: `abort` raises."""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: object = None) -> None:
        raise Aborted(code, details)


def info(worker_id: str, model: str = MODEL, block_size: int = BS, component: str = DECODE_WORKER) -> InstanceInfo:
    return InstanceInfo(component=component, instance_id=worker_id, address=f"{worker_id}.test:1",
                        model=model, block_size=block_size)


def make_pool(*workers: InstanceInfo, component: str = DECODE_WORKER) -> WorkerPool:
    # The channel pool is only used to follow a worker's streams, which admit() never starts.
    pool = WorkerPool(FakeView(component), None)  # type: ignore[arg-type]
    for worker in workers:
        assert pool.admit(worker.instance_id, worker)
    return pool


def view_of(pool: WorkerPool) -> FakeView:
    assert isinstance(pool.view, FakeView)
    return pool.view


def cache(pool: WorkerPool, worker_id: str, tokens: list[int]) -> None:
    """The worker reports its engine cached `tokens` (one stored event, from the root)."""
    blocks = list(zip(chained_block_hashes(tokens, BS), local_block_hashes(tokens, BS)))
    pool.index.store(worker_id, None, blocks)


def set_load(pool: WorkerPool, worker_id: str, **fields: int) -> None:
    pool.workers[worker_id].observe_load(worker_pb2.LoadMetrics(kv_total_blocks=1000, **fields))


@dataclass
class Served:
    servicer: RouterServicer
    registry: CollectorRegistry

    async def route(self, role: int = 0, model: str = MODEL, tokens: list[int] | None = None,
                    exclude: tuple[str, ...] = ()) -> router_pb2.RouteResponse:
        request = router_pb2.RouteRequest(request_id="r", model=model, token_ids=PROMPT if tokens is None else tokens,
                                          role=role, exclude_worker_ids=exclude)
        return await self.servicer.Route(request, AbortingContext())

    async def find_matches(self, role: int = 0, model: str = MODEL) -> router_pb2.FindMatchesResponse:
        request = router_pb2.FindMatchesRequest(model=model, token_ids=PROMPT, role=role)
        return await self.servicer.FindMatches(request, AbortingContext())

    def no_worker_count(self) -> float:
        return self.registry.get_sample_value("kvmesh_router_no_worker_total") or 0.0


def router(decode: WorkerPool, prefill: WorkerPool | None = None, mode: str = "kv", seed: int | None = 0) -> Served:
    pools = {RoleName.DECODE: decode,
             RoleName.PREFILL: prefill if prefill is not None else make_pool(component=PREFILL_WORKER)}
    registry = CollectorRegistry()
    return Served(RouterServicer(Router(pools, RouterConfig(mode=mode, seed=seed), RouterMetrics(registry))),
                  registry)


# -- pools per role ---------------------------------------------------------------------------


@pytest.mark.parametrize(("role", "expected"), [
    (0, "d1"),  # unspecified is the decode pool
    (DECODE, "d1"),
    (PREFILL, "p1"),
])
async def test_the_role_selects_the_pool(role: int, expected: str) -> None:
    r = router(make_pool(info("d1")), make_pool(info("p1", component=PREFILL_WORKER), component=PREFILL_WORKER))
    response = await r.route(role=role)
    assert (response.worker_id, response.address) == (expected, f"{expected}.test:1")


@pytest.mark.parametrize("call", [Served.route, Served.find_matches])
async def test_an_unknown_role_is_an_invalid_argument(call: Callable) -> None:
    with pytest.raises(Aborted) as aborted:
        await call(router(make_pool(info("d1"))), role=7)
    assert aborted.value.code == grpc.StatusCode.INVALID_ARGUMENT


# -- no eligible worker -----------------------------------------------------------------------


@pytest.mark.parametrize(("workers", "model", "exclude"), [
    ((), MODEL, ()),  # an empty pool
    (("a",), "other", ()),  # nobody serves the model
    (("a", "b"), MODEL, ("a", "b")),  # everyone serving it is excluded
])
async def test_no_eligible_worker_is_not_found_and_counted(workers: tuple[str, ...], model: str,
                                                          exclude: tuple[str, ...]) -> None:
    r = router(make_pool(*(info(w) for w in workers)))
    with pytest.raises(Aborted) as aborted:
        await r.route(model=model, exclude=exclude)
    assert aborted.value.code == grpc.StatusCode.NOT_FOUND
    assert aborted.value.details == f"no {DECODE_WORKER} serves model {model!r}"
    assert r.no_worker_count() == 1


@pytest.mark.parametrize(("exclude", "allowed"), [
    ((), {"b"}),  # b caches the prefix
    (("b",), {"a", "c"}),  # b failed the caller: anyone else, though only b caches it
    (("a", "b"), {"c"}),
])
async def test_excluded_workers_are_never_chosen(exclude: tuple[str, ...], allowed: set[str]) -> None:
    for seed in range(5):
        pool = make_pool(info("a"), info("b"), info("c"))
        cache(pool, "b", PROMPT)
        assert (await router(pool, seed=seed).route(exclude=exclude)).worker_id in allowed


# -- kv mode and pending accounting -----------------------------------------------------------


async def test_kv_mode_picks_the_worker_caching_the_prefix_and_reports_its_overlap() -> None:
    pool = make_pool(info("a"), info("b"), info("c"))
    cache(pool, "a", PROMPT[:BS])
    cache(pool, "b", PROMPT[: 3 * BS])
    response = await router(pool).route()
    assert (response.worker_id, response.overlap_blocks) == ("b", 3)
    assert response.prefix_hit_rate == pytest.approx(3 / 4)


async def test_among_idle_workers_a_new_prefix_goes_to_the_one_caching_the_fewest_blocks() -> None:
    for seed in range(5):
        pool = make_pool(info("full"), info("empty"))
        cache(pool, "full", list(range(5000, 5000 + 8 * BS)))  # another prompt altogether
        assert (await router(pool, seed=seed).route()).worker_id == "empty"


async def test_back_to_back_routes_spread_over_an_idle_pool_by_their_pending_work() -> None:
    pool = make_pool(info("a"), info("b"))
    set_load(pool, "a")
    set_load(pool, "b")
    r = router(pool)
    first = await r.route()
    second = await r.route()
    assert {first.worker_id, second.worker_id} == {"a", "b"}
    # The pool's queue as each request finds it: the first request is pending on its worker.
    assert (first.pool_waiting, second.pool_waiting) == (0, 1)
    # Each worker owes one request of four new blocks until its next metrics report.
    assert pool.workers["a"].pending_counts() == pool.workers["b"].pending_counts() == (1, 4)


async def test_pending_blocks_count_only_what_the_worker_does_not_cache() -> None:
    pool = make_pool(info("a"))
    cache(pool, "a", PROMPT[: 3 * BS])
    await router(pool).route()
    assert pool.workers["a"].pending_counts() == (1, 1)


def test_pending_blocks_are_a_running_sum_that_follows_the_bounded_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sum routing reads per request is kept with the queue: right after the queue's bound drops
    the oldest entries and after a report retires those older than its grace."""
    state = make_pool(info("a")).workers["a"]
    now = [100.0]
    monkeypatch.setattr("services.routing.worker_pool.time.monotonic", lambda: now[0])
    entries = []
    for i in range(MAX_PENDING + 10):
        now[0] += 0.001
        blocks = 1 + i % 7
        state.add_pending(blocks)
        entries.append((now[0], blocks))
    kept = entries[-MAX_PENDING:]
    assert state.pending_counts() == (MAX_PENDING, sum(b for _, b in kept))
    now[0] = kept[99][0] + PENDING_GRACE_S  # a report: entries older than the grace are retired
    state.observe_load(worker_pb2.LoadMetrics())
    left = [b for t, b in kept if t >= now[0] - PENDING_GRACE_S]
    assert state.pending_counts() == (len(left), sum(left)) and len(left) == MAX_PENDING - 99


async def test_pool_waiting_adds_reported_queues_to_pending_requests_of_the_candidates() -> None:
    pool = make_pool(info("a"), info("b"), info("c"))
    set_load(pool, "a", num_requests_waiting=3)
    set_load(pool, "b", num_requests_waiting=2)
    set_load(pool, "c", num_requests_waiting=50)
    r = router(pool)
    assert (await r.route(exclude=("c",))).pool_waiting == 5
    assert (await r.route(exclude=("c",))).pool_waiting == 6


# -- the other modes --------------------------------------------------------------------------


async def test_round_robin_cycles_in_instance_id_order_whatever_is_cached() -> None:
    pool = make_pool(info("c"), info("a"), info("b"))
    cache(pool, "c", PROMPT)
    r = router(pool, mode="round-robin")
    picks = [(await r.route()).worker_id for _ in range(4)]
    assert picks == ["a", "b", "c", "a"]


async def test_round_robin_still_reports_the_chosen_workers_overlap() -> None:
    pool = make_pool(info("a"), info("b"))
    cache(pool, "a", PROMPT[: 2 * BS])
    response = await router(pool, mode="round-robin").route()
    assert (response.worker_id, response.overlap_blocks) == ("a", 2)


async def test_random_mode_with_a_seed_draws_from_that_seed_in_pool_order() -> None:
    workers = ["w2", "w0", "w1"]
    pool = make_pool(*(info(w) for w in workers))
    cache(pool, "w0", PROMPT)  # ignored by the random mode
    r = router(pool, mode="random", seed=7)
    picks = [(await r.route()).worker_id for _ in range(20)]
    expected_rng = random.Random(7)
    assert picks == [expected_rng.choice(workers) for _ in range(20)]
    again = router(make_pool(*(info(w) for w in workers)), mode="random", seed=7)
    assert [(await again.route()).worker_id for _ in range(20)] == picks


async def test_kv_mode_with_a_seed_repeats_its_tie_breaks() -> None:
    async def picks() -> list[str]:
        r = router(make_pool(*(info(f"w{i}") for i in range(4))), seed=3)
        return [(await r.route(tokens=list(range(i * 100, i * 100 + 2 * BS)))).worker_id for i in range(12)]

    assert await picks() == await picks()


def test_every_router_mode_has_a_picker_and_an_unknown_mode_is_refused() -> None:
    assert ROUTER_MODES == tuple(PICKERS) == ("kv", "round-robin", "random")
    with pytest.raises(ValueError, match="fastest"):
        make_picker("fastest", random.Random(0), CostWeights())


# -- admission ----------------------------------------------------------------------------------


async def test_a_worker_with_another_block_size_for_the_same_model_is_refused() -> None:
    pool = make_pool(info("a"))
    view_of(pool).announce("b", info("b", block_size=2 * BS))  # the discovery listener path
    assert set(pool.workers) == {"a"}
    with pytest.raises(Aborted) as aborted:
        await router(pool).route(exclude=("a",))
    assert aborted.value.code == grpc.StatusCode.NOT_FOUND
    # Another model may have its own block size.
    assert pool.admit("c", info("c", model="other", block_size=2 * BS))
    assert pool.block_size("other") == 2 * BS


async def test_once_a_models_last_worker_leaves_a_newcomer_may_bring_another_block_size() -> None:
    pool = make_pool(info("a"))
    cache(pool, "a", PROMPT)
    view_of(pool).announce("a", None)  # its lease is gone
    assert pool.workers == {} and pool.index.block_count("a") == 0 and pool.block_size(MODEL) is None
    assert pool.admit("b", info("b", block_size=2 * BS))
    assert pool.block_size(MODEL) == 2 * BS


async def test_a_known_worker_re_registering_is_updated_not_added_again() -> None:
    pool = make_pool(info("a"))
    moved = InstanceInfo(component=DECODE_WORKER, instance_id="a", address="elsewhere:2", model=MODEL, block_size=BS)
    assert not pool.admit("a", moved)
    assert (await router(pool).route()).address == "elsewhere:2"


# -- FindMatches ----------------------------------------------------------------------------------


async def test_find_matches_scores_only_the_workers_serving_the_model() -> None:
    pool = make_pool(info("a"), info("b"), info("c", model="other"))
    cache(pool, "a", PROMPT[: 2 * BS])
    cache(pool, "b", PROMPT)
    cache(pool, "c", PROMPT)  # same tokens, same block size, another model: not a match
    response = await router(pool).find_matches()
    assert dict(response.scores) == {"a": 2, "b": 4}
    assert response.block_size == BS


async def test_find_matches_for_a_model_nobody_serves_is_empty() -> None:
    response = await router(make_pool(info("a"))).find_matches(model="other")
    assert dict(response.scores) == {} and response.block_size == 0


async def test_find_matches_reads_the_pool_of_the_requested_role() -> None:
    prefill = make_pool(info("p1", component=PREFILL_WORKER), component=PREFILL_WORKER)
    cache(prefill, "p1", PROMPT)
    r = router(make_pool(info("d1")), prefill)
    assert dict((await r.find_matches(role=PREFILL)).scores) == {"p1": 4}
    assert dict((await r.find_matches(role=0)).scores) == {}
