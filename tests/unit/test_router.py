"""The `Router` on plain values, as a processor routing locally calls it, and the wire around it
for held calls: what it answers, its named refusals, the host credit worked out once, and a
request that goes through admission. Hand-built pools as in test_router_route.py; no process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import cast

import pytest
from prometheus_client import CollectorRegistry

from gen.kvmesh.v1 import common_pb2, router_pb2, worker_pb2
from services.contract.worker_roles import RoleName
from services.kv_protocol.hashing import chained_block_hashes, local_block_hashes
from services.kv_protocol.tier import Tier
from services.mesh.session_kind import CallError, CallInfo
from services.processor.local_router import LocalRouter
from services.routing import host_credit as host_credit_module
from services.routing.admission.admission_metrics import AdmissionMetrics
from services.routing.admission.gate import Admission, AdmissionConfig, Ticket
from services.routing.admission.tenant_policy import DEFAULT_TENANT
from services.routing.config import RouterConfig
from services.routing.cost_function import CostWeights
from services.routing.host_credit import FALLBACK_CREDIT
from services.routing.route_query import NoWorker, Qos, Route, RouteQuery, UnknownPool
from services.routing.router import Router
from services.routing.router_client import Admit, NoWorkerError, Overloaded
from services.routing.router_metrics import RouterMetrics
from services.routing.servicer import RouterServicer
from services.routing.worker_pool import WorkerPool
from tests.unit.test_router_route import BS, MODEL, PROMPT, cache, info, make_pool

SLOTS = 2


def router(pool: WorkerPool, mode: str = "kv", weights: CostWeights | None = None,
           admission: Admission | None = None) -> tuple[Router, CollectorRegistry]:
    registry = CollectorRegistry()
    config = RouterConfig(mode=mode, seed=0, weights=weights or CostWeights())
    return Router({RoleName.DECODE: pool}, config, RouterMetrics(registry), admission), registry


def query(**fields: object) -> RouteQuery:
    return RouteQuery("r", MODEL, PROMPT, **fields)  # type: ignore[arg-type]


def cache_in_host_memory(pool: WorkerPool, worker_id: str, tokens: list[int]) -> None:
    blocks = list(zip(chained_block_hashes(tokens, BS), local_block_hashes(tokens, BS)))
    pool.index.store(worker_id, None, blocks, Tier.HOST)


def admitting_pool(workers: int = 1) -> tuple[WorkerPool, Admission]:
    pool = make_pool(*(info(f"w{i}") for i in range(workers)))
    for worker in pool.workers.values():
        worker.load = worker_pb2.LoadMetrics(request_total_slots=SLOTS)
    gate = Admission(pool, AdmissionConfig(worker_queue=0), AdmissionMetrics(CollectorRegistry()))
    return pool, gate


# -- deciding ---------------------------------------------------------------------------------


def test_a_decision_is_plain_values_and_explains_itself_only_when_asked() -> None:
    pool = make_pool(info("a"), info("b"))
    cache(pool, "b", PROMPT)
    r, _ = router(pool)
    route = r.decide(query())
    assert route == Route("b", "b.test:1", overlap_blocks=4, host_overlap_blocks=0, prefix_hit_rate=1.0,
                          pool_waiting=0)
    explained = r.decide(query(explain=True)).explanation
    assert explained is not None and explained.chosen == "b" and len(explained.ranked) == 2


def test_no_worker_and_no_pool_are_named_refusals() -> None:
    r, registry = router(make_pool(info("a")))
    with pytest.raises(NoWorker, match=f"no decode-worker serves model {MODEL!r}"):
        r.decide(query(exclude=frozenset({"a"})))
    assert registry.get_sample_value("kvmesh_router_no_worker_total") == 1
    with pytest.raises(UnknownPool):
        r.decide(query(role=RoleName.PREFILL))


def test_an_avoided_worker_is_passed_over_while_another_serves_and_taken_when_none_does() -> None:
    pool = make_pool(info("a"), info("b"))
    cache(pool, "a", PROMPT)  # the avoided worker would otherwise win on its cache
    r, registry = router(pool)
    assert r.decide(query(avoid=frozenset({"a"}))).worker_id == "b"
    # The one healthy peer has left (its lease lapsed): the avoided worker serves rather than a refusal.
    assert r.decide(query(avoid=frozenset({"a"}), exclude=frozenset({"b"}))).worker_id == "a"
    assert r.decide(query(avoid=frozenset({"a", "b"}))).worker_id == "a"
    assert registry.get_sample_value("kvmesh_router_no_worker_total") == 0


@pytest.mark.parametrize("mode", ["kv", "round-robin"])
def test_the_host_credit_is_worked_out_once_and_weighed_alike_by_pick_explanation_and_hit_rate(
        mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = make_pool(info("host"))
    cache_in_host_memory(pool, "host", PROMPT)  # a worker that says no prefill cost: the fallback credit
    calls: list[str] = []
    real = host_credit_module.host_credit

    def counted(load: worker_pb2.LoadMetrics, *args: object) -> float:
        calls.append("host")
        return real(load, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(host_credit_module, "host_credit", counted)
    route = router(pool, mode)[0].decide(query(explain=True))
    assert calls == ["host"]
    assert (route.overlap_blocks, route.host_overlap_blocks) == (0, 4)
    assert route.prefix_hit_rate == pytest.approx(FALLBACK_CREDIT)
    assert route.explanation is not None
    assert [t.host_credit for t in route.explanation.ranked] == ([FALLBACK_CREDIT] if mode == "kv" else [])


def test_a_fixed_host_weight_replaces_the_derived_credit_in_the_hit_rate() -> None:
    pool = make_pool(info("host"))
    cache_in_host_memory(pool, "host", PROMPT)
    route = router(pool, weights=CostWeights(host_overlap=0.5))[0].decide(query())
    assert route.prefix_hit_rate == pytest.approx(0.5)


# -- admission --------------------------------------------------------------------------------


async def test_an_admitted_query_is_placed_on_a_worker_with_room_and_holds_its_place() -> None:
    pool, gate = admitting_pool()
    r, _ = router(pool, admission=gate)
    assert r.admits(RoleName.DECODE) and not r.admits(RoleName.PREFILL)
    route, ticket = await r.admit(query(qos=Qos(tenant="t"), streams=2))
    assert (route.worker_id, route.queue_wait_ms) == ("w0", 0)
    assert gate.own == {"w0": 2}
    ticket.release()
    assert not gate.own


async def test_a_query_no_worker_serves_is_refused_at_once_not_queued() -> None:
    pool, gate = admitting_pool()
    r, _ = router(pool, admission=gate)
    with pytest.raises(NoWorker):
        r.enter(RouteQuery("r", "other", PROMPT))
    assert gate.queued() == 0 and not gate.usage.in_flight(DEFAULT_TENANT)


async def test_a_held_call_is_told_it_waits_then_gets_its_worker_and_gives_the_place_back_at_its_end() -> None:
    pool, gate = admitting_pool()
    servicer = RouterServicer(router(pool, admission=gate)[0])
    tickets = [gate.begin(query()) for _ in range(SLOTS)]
    for ticket in tickets:
        assert isinstance(ticket, Ticket)
        ticket.placed("w0")  # both slots taken: the next call waits
    request = router_pb2.RouteRequest(request_id="r", model=MODEL, token_ids=PROMPT, hold=True)
    call = cast(AsyncGenerator[router_pb2.RouteResponse, None], servicer.route(request, CallInfo({})))
    assert (await anext(call)).queued
    assert isinstance(tickets[0], Ticket)
    tickets[0].release()
    reply = await asyncio.wait_for(anext(call), 1)
    assert reply.worker_id == "w0" and not reply.queued
    assert gate.own == {"w0": 2}
    await call.aclose()  # the caller ends the call: its place comes back
    assert gate.own == {"w0": 1}


# -- the processor's local routing ------------------------------------------------------------


async def test_local_routing_answers_as_the_routers_client_does() -> None:
    pool, gate = admitting_pool()
    cache(pool, "w0", PROMPT)
    local = LocalRouter(router(pool, admission=gate)[0])
    choice = await local.route("r", MODEL, PROMPT, common_pb2.WORKER_ROLE_DECODE, explain=True)
    assert (choice.worker_id, choice.overlap_blocks, choice.prefix_hit_rate) == ("w0", 4, 1.0)
    assert choice.explanation is not None and choice.explanation.mode == "kv"
    with pytest.raises(NoWorkerError):
        await local.route("r", MODEL, PROMPT, common_pb2.WORKER_ROLE_DECODE, exclude=["w0"])
    admit = Admit(common_pb2.Qos(tenant="t"), streams=SLOTS, queue_timeout_s=0.01)
    choice, held = await local.admit("r", MODEL, PROMPT, admit)
    assert choice.worker_id == "w0" and choice.explanation is None
    with pytest.raises(Overloaded) as refused:
        await local.admit("r", MODEL, PROMPT, admit)  # no room within its 10 ms
    assert isinstance(refused.value.error, CallError)
    assert refused.value.error.overload == common_pb2.OVERLOAD_QUEUE_EXPIRED
    held.release()
    assert not gate.own and gate.queued() == 0
