"""Admission driven in-process on a hand-built pool (a real WorkerPool whose workers' load is set
by hand, as their reports would set it): who runs at once, who waits and in what order, who is
refused at once and with what, and that every place taken is given back."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from prometheus_client import CollectorRegistry

from gen.kvmesh.v1 import common_pb2, router_pb2, worker_pb2
from services.contract.worker_roles import RoleName
from services.mesh.discovery import DECODE_WORKER, InstanceInfo
from services.mesh.session_kind import CallError
from services.routing.admission.admission_metrics import AdmissionMetrics
from services.routing.admission.gate import Admission, AdmissionConfig, Queued, Ticket
from services.routing.admission.tenant_policy import DEFAULT_TENANT, PolicyFile, TenantPolicies, TenantPolicy
from services.routing.route_query import Qos, RouteQuery
from services.routing.worker_pool import WorkerPool
from tests.unit.clocks import until
from tests.unit.test_router_route import FakeView

MODEL = "m"
SLOTS = 2


def gate_with(workers: int = 1, config: AdmissionConfig | None = None, policies: PolicyFile | None = None
              ) -> tuple[Admission, WorkerPool]:
    pool = WorkerPool(FakeView(DECODE_WORKER), None)  # type: ignore[arg-type]
    for i in range(workers):
        wid = f"w{i}"
        pool.admit(wid, InstanceInfo(component=DECODE_WORKER, instance_id=wid, address=f"{wid}:1", model=MODEL,
                                     block_size=4))
        pool.workers[wid].load = worker_pb2.LoadMetrics(request_total_slots=SLOTS)
    config = config or AdmissionConfig(ttft_objective_s=1.0, worker_queue=0)
    return Admission(pool, config, AdmissionMetrics(CollectorRegistry()), policies), pool


def request(tenant: str = "", priority: int = 0, objective_ms: int = 0, tokens: int = 8, streams: int = 1,
            max_tokens: int = 0) -> RouteQuery:
    return RouteQuery("r", MODEL, list(range(tokens)), streams=streams, max_tokens=max_tokens,
                      qos=Qos(tenant=tenant, priority=priority, ttft_objective_ms=objective_ms))


def place(gate: Admission, ticket: Ticket, worker: str = "w0") -> Ticket:
    ticket.placed(worker)
    return ticket


def refusal(exc: pytest.ExceptionInfo[CallError]) -> tuple[common_pb2.Outcome, common_pb2.Overload]:
    return exc.value.outcome, exc.value.overload


async def test_a_worker_with_room_takes_the_request_at_once_and_the_place_comes_back() -> None:
    gate, _ = gate_with()
    first = place(gate, gate.begin(request()))  # type: ignore[arg-type]
    second = place(gate, gate.begin(request()))  # type: ignore[arg-type]
    assert isinstance(first, Ticket) and isinstance(second, Ticket)
    assert gate.own == {"w0": 2}
    assert isinstance(gate.begin(request()), Queued)  # both slots taken: it waits
    first.release()
    first.release()  # idempotent
    await asyncio.sleep(0)
    assert gate.own == {"w0": 1} and gate.queued() == 0


async def test_waiters_are_woken_in_the_queues_order_as_places_come_back() -> None:
    gate, _ = gate_with(config=AdmissionConfig(worker_queue=0))  # no objective: nobody refused
    held = [place(gate, gate.begin(request())) for _ in range(SLOTS)]  # type: ignore[arg-type]
    waits = {name: gate.begin(request(tenant, prio)) for name, tenant, prio in
             [("a1", "a", 0), ("a2", "a", 0), ("b1", "b", 0), ("high", "c", -1)]}
    order: list[str] = []

    async def wait(name: str, queued: Queued) -> None:
        ticket = await gate.wait(queued)
        order.append(name)
        place(gate, ticket)

    tasks = [asyncio.create_task(wait(n, q)) for n, q in waits.items()]  # type: ignore[arg-type]
    await asyncio.sleep(0)
    for woken, ticket in enumerate(held, start=1):
        ticket.release()
        await until(lambda: len(order) == woken)  # noqa: B023 - awaited within the iteration
    for _ in range(10):
        await asyncio.sleep(0)  # nobody else is woken meanwhile
    assert order == ["high", "a1"]
    gate.own.clear()  # the two now running end at once
    gate.pump()
    await asyncio.gather(*tasks)
    assert order == ["high", "a1", "b1", "a2"]


async def test_a_request_that_would_miss_its_objective_is_refused_at_once_with_when_to_retry() -> None:
    gate, _ = gate_with(config=AdmissionConfig(ttft_objective_s=1.0, worker_queue=0))
    for _ in range(SLOTS):
        place(gate, gate.begin(request()))  # type: ignore[arg-type]
    gate.forecaster.hold.observe(3.0)  # a request holds a slot 3 s: one slot frees every 1.5 s
    with pytest.raises(CallError) as exc:
        gate.begin(request())
    assert refusal(exc) == (common_pb2.OUTCOME_OVERLOADED, common_pb2.OVERLOAD_PREDICTED_LATENCY)
    assert exc.value.retry_after_ms >= 1
    # Its own, looser objective admits it; a tighter one than the deployment's refuses sooner.
    assert isinstance(gate.begin(request(objective_ms=5000)), Queued)
    assert gate.usage.in_flight(DEFAULT_TENANT) == SLOTS + 1


async def test_a_waiter_that_cannot_start_in_time_is_refused_and_leaves_no_trace() -> None:
    gate, _ = gate_with(config=AdmissionConfig(ttft_objective_s=0.05, worker_queue=0))
    for _ in range(SLOTS):
        place(gate, gate.begin(request()))  # type: ignore[arg-type]
    gate.forecaster.hold.observe(0.01)  # predicted to be quick, but nothing ends
    queued = gate.begin(request())
    assert isinstance(queued, Queued)
    with pytest.raises(CallError) as exc:
        await gate.wait(queued)
    assert refusal(exc) == (common_pb2.OUTCOME_OVERLOADED, common_pb2.OVERLOAD_QUEUE_EXPIRED)
    assert gate.queued() == 0 and gate.usage.in_flight(DEFAULT_TENANT) == SLOTS


async def test_a_cancelled_waiter_leaves_the_queue_and_a_woken_one_hands_its_place_on() -> None:
    gate, _ = gate_with(config=AdmissionConfig(worker_queue=0))
    held = [place(gate, gate.begin(request())) for _ in range(SLOTS)]  # type: ignore[arg-type]
    first, second = gate.begin(request()), gate.begin(request())
    assert isinstance(first, Queued) and isinstance(second, Queued)
    waiting = asyncio.create_task(gate.wait(first))
    other = asyncio.create_task(gate.wait(second))
    await asyncio.sleep(0)
    held[0].release()  # wakes `first`...
    waiting.cancel()  # ...which leaves before taking the place: `second` gets it
    ticket = await asyncio.wait_for(other, 1)
    assert isinstance(ticket, Ticket) and gate.queued() == 0
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def test_the_queue_bound_refuses_at_once() -> None:
    gate, _ = gate_with(config=AdmissionConfig(worker_queue=0, max_queued=2))
    for _ in range(SLOTS):
        place(gate, gate.begin(request()))  # type: ignore[arg-type]
    gate.begin(request())
    gate.begin(request())
    with pytest.raises(CallError) as exc:
        gate.begin(request())
    assert refusal(exc)[1] == common_pb2.OVERLOAD_QUEUE_FULL


async def test_a_tenants_limits_refuse_its_requests_only(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.small]\nmax_concurrency = 1\n[tenants.thrifty]\ntokens_per_minute = 20\n")
    gate, _ = gate_with(workers=2, policies=PolicyFile(str(path)))
    place(gate, gate.begin(request("small")))  # type: ignore[arg-type]
    with pytest.raises(CallError) as exc:
        gate.begin(request("small"))
    assert refusal(exc)[1] == common_pb2.OVERLOAD_TENANT_CONCURRENCY
    place(gate, gate.begin(request("thrifty", tokens=15)), "w1")  # type: ignore[arg-type]
    with pytest.raises(CallError) as exc:
        gate.begin(request("thrifty", tokens=15))
    assert refusal(exc)[1] == common_pb2.OVERLOAD_TENANT_TOKENS
    assert isinstance(gate.begin(request("other")), Ticket)


async def test_a_release_frees_room_before_the_workers_next_report() -> None:
    gate, pool = gate_with(config=AdmissionConfig(worker_queue=0))
    tickets = [place(gate, gate.begin(request())) for _ in range(SLOTS)]  # type: ignore[arg-type]
    pool.workers["w0"].load.request_active_slots = SLOTS  # the worker reported both running
    assert gate.room(pool.workers["w0"]) == 0
    tickets[0].release()
    assert gate.room(pool.workers["w0"]) == 1  # the report still counts it; the release knows better
    gate._reported("w0")  # noqa: SLF001 - a new report arrives (it counts both still, say)
    assert gate.room(pool.workers["w0"]) == 0


async def test_a_tenants_top_priority_bounds_the_band_its_requests_take(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.pushy]\ntop_priority = 0\n")
    gate, _ = gate_with(config=AdmissionConfig(worker_queue=0), policies=PolicyFile(str(path)))
    for _ in range(SLOTS):
        place(gate, gate.begin(request()))  # type: ignore[arg-type]
    pushy = gate.begin(request("pushy", priority=-9))
    trusted = gate.begin(request("trusted", priority=-1))
    assert isinstance(pushy, Queued) and isinstance(trusted, Queued)
    assert pushy.entry.band == 0 and trusted.entry.band == -1  # type: ignore[union-attr]


async def test_tokens_per_minute_charge_every_choice() -> None:
    gate, _ = gate_with(workers=2)
    gate.policies.policies = TenantPolicies(tenants={"t": TenantPolicy(tokens_per_minute=100)})
    many = request("t", tokens=10, max_tokens=20, streams=4)  # 10 + 20 x 4 = 90
    place(gate, gate.begin(many))  # type: ignore[arg-type]
    with pytest.raises(CallError) as exc:
        gate.begin(request("t", tokens=11))
    assert refusal(exc)[1] == common_pb2.OVERLOAD_TENANT_TOKENS


async def test_at_a_drain_the_waiters_are_sent_to_another_router_and_nothing_is_learnt() -> None:
    gate, _ = gate_with(config=AdmissionConfig(worker_queue=0))
    held = [place(gate, gate.begin(request())) for _ in range(SLOTS)]  # type: ignore[arg-type]
    queued = gate.begin(request())
    assert isinstance(queued, Queued)
    waiting = asyncio.create_task(gate.wait(queued))
    await asyncio.sleep(0)
    gate.drain()
    with pytest.raises(CallError) as exc:
        await waiting
    assert exc.value.outcome == common_pb2.OUTCOME_PEER_DRAINING  # asked of another router
    for ticket in held:
        ticket.release()
    assert gate.forecaster.hold.mean_s is None and gate.queued() == 0 and not gate.own


async def test_a_waiter_abandoned_before_it_waited_leaves_the_queue() -> None:
    gate, _ = gate_with(config=AdmissionConfig(worker_queue=0))
    held = [place(gate, gate.begin(request())) for _ in range(SLOTS)]  # type: ignore[arg-type]
    queued = gate.begin(request())
    assert isinstance(queued, Queued)
    gate.abandon(queued)
    assert gate.queued() == 0 and gate.usage.in_flight(DEFAULT_TENANT) == SLOTS
    held[0].release()
    assert gate.room(gate._pool.workers["w0"]) == 1  # noqa: SLF001 - nobody took the freed place


async def test_a_unary_route_cannot_hold_a_place() -> None:
    from services.routing.config import RouterConfig
    from services.routing.router import Router
    from services.routing.router_metrics import RouterMetrics
    from services.routing.servicer import RouterServicer
    from tests.unit.test_router_route import Aborted, AbortingContext

    gate, pool = gate_with()
    router = Router({RoleName.DECODE: pool}, RouterConfig(), RouterMetrics(CollectorRegistry()), gate)
    servicer = RouterServicer(router)
    held = router_pb2.RouteRequest(model=MODEL, token_ids=list(range(8)), hold=True, streams=1)
    with pytest.raises(Aborted) as exc:
        await servicer.Route(held, AbortingContext())  # type: ignore[arg-type]
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT and not gate.own and not gate.queued()
    held.hold = False
    assert (await servicer.Route(held, AbortingContext())).worker_id == "w0"  # type: ignore[arg-type]


async def test_loading_a_lora_adapter_counts_in_the_predicted_time_to_first_token() -> None:
    gate, pool = gate_with(config=AdmissionConfig(ttft_objective_s=1.0, worker_queue=0))
    worker = pool.workers["w0"]
    worker.info = dataclasses.replace(worker.info, lora_adapters=("cold", "warm"))
    worker.observe_load(worker_pb2.LoadMetrics(request_total_slots=SLOTS, max_loras=1, lora_adapters=[
        worker_pb2.LoraAdapterState(lora_name="cold", load_s=2.0),
        worker_pb2.LoraAdapterState(lora_name="warm", resident=True)]))
    for _ in range(SLOTS):
        place(gate, gate.begin(request()))  # type: ignore[arg-type]
    gate.forecaster.hold.observe(0.5)  # the queue alone keeps a request well within its objective
    assert isinstance(gate.begin(dataclasses.replace(request(), lora_name="warm")), Queued)
    with pytest.raises(CallError) as exc:  # the 2 s load does not fit
        gate.begin(dataclasses.replace(request(), lora_name="cold"))
    assert refusal(exc) == (common_pb2.OUTCOME_OVERLOADED, common_pb2.OVERLOAD_PREDICTED_LATENCY)
