"""Routing requests of LoRA adapters: an adapter's prompt matches only blocks that adapter
computed, only workers that know the adapter are candidates, both cost rules weigh loading it
where it is not resident (and take it as resident where this router just sent a request of it),
and every explanation, header and metric says which adapter. Hand-built pools as in
test_router_route.py; no process."""

from __future__ import annotations

import argparse
import dataclasses
import math
import random

import pytest
from prometheus_client import CollectorRegistry

from gen.kvmesh.v1 import common_pb2, router_pb2, worker_pb2
from services.contract.worker_roles import RoleName
from services.frontend.route_header import route_header
from services.kv_protocol.hashing import adapter_seed, chained_block_hashes, local_block_hashes
from services.config_error import ConfigError
from services.mesh.discovery import InstanceInfo
from services.processor.local_router import LocalRouter
from services.routing import router_metrics
from services.routing.config import RouterConfig
from services.routing.cost_function import (FALLBACK_PREFILL_S_PER_TOKEN, LORA_LOAD_CAP, Candidate, CostModel,
                                            CostWeights, adapter_penalty, choose, logits)
from services.routing.dynamo_cost import DynamoCostConfig, breakdown
from services.routing.flags import add_router_flags, router_config
from services.routing.pickers import PickContext, make_picker
from services.routing.route_query import NoWorker, RouteQuery
from services.routing.router import Router
from services.routing.router_client import NoWorkerError
from services.routing.router_metrics import RouterMetrics
from services.routing.worker_adapters import (PENDING_ADAPTER_S, SLOTS_BUSY_WAIT_S, UNREPORTED_LOAD_S, AdapterView,
                                             WorkerAdapters)
from services.routing.worker_pool import WorkerPool, WorkerState
from tests.unit.test_router_route import BS, MODEL, PROMPT, AbortingContext, Aborted, info, make_pool, router

TOKENS = 128  # the cost-rule cases: 8 blocks of 16
W = CostWeights()


def knowing(worker_id: str, *adapters: str) -> InstanceInfo:
    """A worker whose etcd record lists these adapters."""
    return dataclasses.replace(info(worker_id), lora_adapters=adapters)


def cache_with(pool: WorkerPool, worker_id: str, tokens: list[int], lora_name: str) -> None:
    """The worker's engine reports `tokens` cached, computed with adapter `lora_name` ("" the base
    model): its local hashes seeded with the adapter's seed, as every engine sends them."""
    seed = adapter_seed(lora_name)
    sequence = [h ^ seed for h in chained_block_hashes(tokens, BS)]  # an engine's own ids: apart per adapter
    pool.index.store(worker_id, None, list(zip(sequence, local_block_hashes(tokens, BS, seed))))


def lora_load(*states: tuple[str, bool, float], **fields: float) -> worker_pb2.LoadMetrics:
    return worker_pb2.LoadMetrics(
        kv_total_blocks=1000, max_loras=4,
        lora_adapters=[worker_pb2.LoraAdapterState(lora_name=n, resident=r, load_s=s) for n, r, s in states],
        **fields)  # type: ignore[arg-type]


def lora_router(pool: WorkerPool, weights: CostWeights | None = None) -> tuple[Router, CollectorRegistry]:
    registry = CollectorRegistry()
    config = RouterConfig(seed=0, weights=weights or CostWeights())
    return Router({RoleName.DECODE: pool}, config, RouterMetrics(registry)), registry


def ask(lora_name: str, rid: str = "r", **fields: object) -> RouteQuery:
    return RouteQuery(rid, MODEL, PROMPT, lora_name=lora_name, **fields)  # type: ignore[arg-type]


# -- the cache kept apart ---------------------------------------------------------------------


def test_an_adapters_prompt_matches_only_the_blocks_that_adapter_computed() -> None:
    pool = make_pool(*(knowing(w, "a", "b") for w in ("base", "wa", "wb")))
    for worker, lora in (("base", ""), ("wa", "a"), ("wb", "b")):
        cache_with(pool, worker, PROMPT, lora)
    r, _ = lora_router(pool)
    assert r.find_matches(RoleName.DECODE, MODEL, PROMPT).device == {"base": 4}
    assert r.find_matches(RoleName.DECODE, MODEL, PROMPT, "a").device == {"wa": 4}
    assert r.find_matches(RoleName.DECODE, MODEL, PROMPT, "b").device == {"wb": 4}
    assert (r.decide(ask("a")).worker_id, r.decide(ask("a")).overlap_blocks) == ("wa", 4)
    route = r.decide(ask(""))
    assert (route.worker_id, route.overlap_blocks, route.prefix_hit_rate) == ("base", 4, 1.0)


async def test_find_matches_on_the_wire_reads_the_adapter_and_its_workers() -> None:
    pool = make_pool(knowing("wa", "a"), info("plain"))
    cache_with(pool, "wa", PROMPT, "a")
    cache_with(pool, "plain", PROMPT, "")
    served = router(pool)
    request = router_pb2.FindMatchesRequest(model=MODEL, token_ids=PROMPT, lora_name="a")
    reply = await served.servicer.FindMatches(request, AbortingContext())
    assert dict(reply.scores) == {"wa": 4}  # "plain" neither knows "a" nor holds its blocks


# -- candidates -------------------------------------------------------------------------------


def test_only_workers_that_know_the_adapter_are_candidates_by_record_or_by_report() -> None:
    pool = make_pool(knowing("by-record", "a"), info("by-report"), info("neither"))
    pool.workers["by-report"].observe_load(lora_load(("a", False, 0.05)))
    assert [w.info.instance_id for w in pool.candidates(MODEL, "a")] == ["by-record", "by-report"]
    assert len(pool.candidates(MODEL)) == 3  # the base model: everyone
    r, _ = lora_router(pool)
    chosen = {r.decide(ask("a", f"r{i}")).worker_id for i in range(12)}
    assert chosen <= {"by-record", "by-report"} and "neither" not in chosen


@pytest.mark.parametrize(("lora_name", "exclude", "message"), [
    ("zzz", (), "no decode-worker serves LoRA adapter 'zzz' of model 'm'"),
    ("a", ("wa",), "no decode-worker serves LoRA adapter 'a' of model 'm'"),
])
def test_an_adapter_no_candidate_knows_is_no_worker_naming_it_and_the_model(
        lora_name: str, exclude: tuple[str, ...], message: str) -> None:
    pool = make_pool(knowing("wa", "a"), info("plain"))
    r, registry = lora_router(pool)
    with pytest.raises(NoWorker, match=message):
        r.decide(ask(lora_name, exclude=frozenset(exclude)))
    assert registry.get_sample_value("kvmesh_router_no_worker_total") == 1


async def test_an_unknown_adapter_is_no_worker_on_the_wire_and_in_local_routing() -> None:
    pool = make_pool(knowing("wa", "a"))
    served = router(pool)
    request = router_pb2.RouteRequest(request_id="r", model=MODEL, token_ids=PROMPT, lora_name="zzz")
    with pytest.raises(Aborted) as aborted:
        await served.servicer.Route(request, AbortingContext())
    assert "'zzz'" in aborted.value.details and "'m'" in aborted.value.details
    local = LocalRouter(lora_router(pool)[0])
    with pytest.raises(NoWorkerError, match="LoRA adapter 'zzz'"):
        await local.route("r", MODEL, PROMPT, common_pb2.WORKER_ROLE_DECODE, lora_name="zzz")
    choice = await local.route("r", MODEL, PROMPT, common_pb2.WORKER_ROLE_DECODE, lora_name="a", explain=True)
    assert choice.worker_id == "wa" and choice.explanation is not None and choice.explanation.lora_name == "a"


# -- the cached-share rule's term -------------------------------------------------------------


def cand(wid: str, waiting: int = 0, load_s: float = 0.0, prefill_s: float | None = 0.1, **kw: object) -> Candidate:
    return Candidate(wid, 0, 0, 1000, waiting, 0.0, adapter_load_s=load_s, prompt_prefill_s=prefill_s,
                     **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("load_s", "prefill_s", "term"), [
    (0.0, 0.1, 0.0),  # resident: no penalty
    (0.01, 0.1, 2 * 0.1),  # a tenth of the prompt's prefill: worth 2 * 0.1
    (0.02, 0.1, 2 * 0.2),
    (0.05, 0.1, 2 * LORA_LOAD_CAP),  # half the prefill: capped
    (3.0, 0.1, 2 * LORA_LOAD_CAP),
    (0.001, None, 2 * 0.001 / (FALLBACK_PREFILL_S_PER_TOKEN * TOKENS)),  # no reported cost: the fallback
])
def test_loading_the_adapter_costs_twice_its_share_of_the_prompts_prefill_capped(
        load_s: float, prefill_s: float | None, term: float) -> None:
    assert logits([cand("w", load_s=load_s, prefill_s=prefill_s)], BS * 4, TOKENS, W) == pytest.approx([-term])


def test_a_resident_adapter_beats_a_cold_one_at_equal_load() -> None:
    cs = [cand("cold", waiting=2, load_s=0.02), cand("resident", waiting=2)]
    assert {choose(cs, 16, TOKENS, W, random.Random(s)).worker_id for s in range(20)} == {"resident"}


@pytest.mark.parametrize(("holder_waiting", "other_waiting", "winner"), [
    (1, 1, "holder"),
    (3, 2, "holder"),  # normalized 1 against 0.67: within the 0.5 the load is worth
    (5, 3, "holder"),
    (10, 4, "other"),  # more than twice the other's queue: the adapter spreads
    (10, 0, "other"),
])
def test_a_holder_keeps_its_adapters_requests_until_its_queue_is_over_twice_a_non_holders(
        holder_waiting: int, other_waiting: int, winner: str) -> None:
    # The other worker's load is expensive (capped): 0.5 in the rule's units.
    cs = [cand("holder", waiting=holder_waiting), cand("other", waiting=other_waiting, load_s=1.0)]
    picks = {choose(cs, 16, TOKENS, W, random.Random(s)).worker_id for s in range(10)}
    assert picks == {winner}


def test_lora_weight_zero_is_adapter_blind_and_the_weight_scales_the_term() -> None:
    cs = [cand("cold", load_s=1.0), cand("resident")]
    assert logits(cs, 16, TOKENS, CostWeights(lora=0.0)) == [0.0, 0.0]
    assert logits(cs, 16, TOKENS, CostWeights(lora=2.0)) == pytest.approx([-2 * 2 * LORA_LOAD_CAP, 0.0])
    assert logits(cs, 16, TOKENS, CostWeights(overlap=4.0)) == pytest.approx([-4 * LORA_LOAD_CAP, 0.0])


# -- the Dynamo rule's term -------------------------------------------------------------------


def test_the_dynamo_rule_adds_the_load_as_the_blocks_whose_prefill_takes_as_long() -> None:
    # The prompt's prefill 0.128 s over 128 tokens: 1 ms a token, 16 ms a block; a 32 ms load is 2 blocks.
    cold = breakdown(cand("cold", load_s=0.032, prefill_s=0.128), 16, TOKENS, DynamoCostConfig())
    resident = breakdown(cand("resident", prefill_s=0.128), 16, TOKENS, DynamoCostConfig())
    assert (cold.adapter_blocks, cold.cost, resident.cost) == (pytest.approx(2.0), pytest.approx(8 + 2 + 8), 16)
    cached = breakdown(Candidate("c", 8, 0, 1000, 0, 0.0, adapter_load_s=0.032, prompt_prefill_s=0.128),
                       16, TOKENS, DynamoCostConfig())
    assert cached.adjusted_prefill_blocks == pytest.approx(2.0)  # a cached prefix takes nothing off the load
    blind = breakdown(cand("cold", load_s=0.032, prefill_s=0.128), 16, TOKENS, DynamoCostConfig(lora_weight=0))
    assert blind.cost == 16
    unreported = breakdown(cand("cold", load_s=0.032, prefill_s=None), 16, TOKENS, DynamoCostConfig())
    assert unreported.adapter_blocks == pytest.approx(0.032 / (FALLBACK_PREFILL_S_PER_TOKEN * 16))


def test_the_kv_picker_gives_both_rules_the_adapter_and_the_workers_prefill_cost() -> None:
    workers = [WorkerState(info("cold"), lora_load(prefill_cost=worker_pb2.PrefillCost(us_per_token=1000))),
               WorkerState(info("warm"), lora_load(prefill_cost=worker_pb2.PrefillCost(us_per_token=1000)))]
    adapters = {"cold": AdapterView(False, 0.032), "warm": AdapterView(True)}
    context = PickContext({}, 16, TOKENS, lambda _: 0, adapters=adapters)
    dynamo = make_picker("kv", random.Random(0), CostWeights(model=CostModel.DYNAMO))
    assert [t.logit for t in dynamo.terms(workers, context)] == pytest.approx([-(8 + 2 + 8), -16])
    cached_share = make_picker("kv", random.Random(0), CostWeights())
    assert [t.logit for t in cached_share.terms(workers, context)] == pytest.approx([-2 * 0.25, 0.0])  # 32 ms / 128 ms
    assert (cached_share.pick(workers, context).info.instance_id == dynamo.pick(workers, context).info.instance_id
            == "warm")


def test_a_bad_lora_weight_names_its_flag() -> None:
    for build in (lambda: CostWeights(lora=-1.0), lambda: CostWeights(lora=math.inf),
                  lambda: DynamoCostConfig(lora_weight=math.nan)):
        with pytest.raises(ConfigError, match="--lora-weight"):
            build()
    parser = argparse.ArgumentParser()
    add_router_flags(parser)
    assert router_config(parser.parse_args([])).weights.lora == 1.0
    assert router_config(parser.parse_args(["--lora-weight", "0"])).weights.lora == 0.0


# -- residency: the workers' reports and this router's own dispatches -------------------------


def test_an_adapter_sent_to_a_worker_is_resident_there_until_reported_or_for_the_pending_window() -> None:
    adapters = WorkerAdapters()
    adapters.observe(lora_load(("a", False, 0.05)), now=0.0)
    assert adapters.view("a", now=0.0) == AdapterView(False, 0.05)
    assert adapters.view("", now=0.0).resident  # the base model is never loaded
    adapters.dispatched("a", now=1.0)
    adapters.observe(lora_load(("a", False, 0.05)), now=1.5)  # reported before its request got there
    assert adapters.view("a", now=1.5).resident
    assert not adapters.view("a", now=1.0 + PENDING_ADAPTER_S).resident  # never confirmed: the report again
    adapters.dispatched("a", now=5.0)
    adapters.observe(lora_load(("a", True, 0.0)), now=5.2)  # confirmed: the report speaks for it
    assert adapters.pending == {} and adapters.view("a", now=5.2).resident
    adapters.observe(lora_load(("a", False, 0.05)), now=6.0)  # evicted since
    assert adapters.view("a", now=6.0) == AdapterView(False, 0.05)


def test_a_worker_known_by_its_record_alone_is_charged_a_default_load() -> None:
    adapters = WorkerAdapters()
    assert adapters.knows("a", ("a",)) and not adapters.knows("a") and adapters.knows("")
    assert adapters.view("a") == AdapterView(False, UNREPORTED_LOAD_S)


def test_a_burst_of_one_adapter_stays_on_the_worker_it_was_first_sent_to() -> None:
    pool = make_pool(*(knowing(w, "a") for w in ("w0", "w1", "w2")))
    cost = worker_pb2.PrefillCost(us_per_token=1000)  # 16 tokens: 16 ms; a 50 ms load is capped
    for worker in pool.workers.values():
        worker.observe_load(lora_load(("a", False, 0.05), num_requests_waiting=4, prefill_cost=cost))
    r, registry = lora_router(pool)
    chosen = [r.decide(ask("a", f"r{i}")).worker_id for i in range(3)]
    assert len(set(chosen)) == 1  # pending residency: the first load serves the burst
    count = registry.get_sample_value
    assert count("kvmesh_router_lora_routes_total", {"lora_name": "a", "resident": "false"}) == 1
    assert count("kvmesh_router_lora_routes_total", {"lora_name": "a", "resident": "true"}) == 2


def test_adapter_blind_routing_spreads_the_same_burst() -> None:
    pool = make_pool(*(knowing(w, "a") for w in ("w0", "w1", "w2")))
    cost = worker_pb2.PrefillCost(us_per_token=1000)
    for worker in pool.workers.values():
        worker.observe_load(lora_load(("a", False, 0.05), num_requests_waiting=4, prefill_cost=cost))
    r, _ = lora_router(pool, CostWeights(lora=0.0))
    assert len({r.decide(ask("a", f"r{i}")).worker_id for i in range(3)}) == 3


# -- what the router says of it ---------------------------------------------------------------


def test_the_explanation_names_the_adapter_and_its_state_on_each_candidate() -> None:
    pool = make_pool(knowing("hot", "a"), knowing("cold", "a"))
    pool.workers["hot"].observe_load(lora_load(("a", True, 0.0)))
    pool.workers["cold"].observe_load(lora_load(("a", False, 0.025)))
    r, _ = lora_router(pool)
    explanation = r.decide(ask("a", explain=True)).explanation
    assert explanation is not None and explanation.lora_name == "a"
    assert "kv mode lora=a chose hot" in explanation.log_line()
    assert "hot overlap=0" in explanation.log_line() and "adapter=resident" in explanation.log_line()
    assert "adapter=load:0.025s" in explanation.log_line()
    wire = explanation.to_proto()
    assert wire.lora_name == "a"
    assert [(c.worker_id, c.adapter_resident, c.adapter_load_s) for c in wire.candidates] == [
        ("hot", True, 0.0), ("cold", False, 0.025)]
    header = route_header(wire)
    assert header.startswith("mode=kv lora=a; chosen=hot ")
    assert " adapter=resident kv_source=events" in header and " adapter=load:0.025s kv_source=events" in header
    attributes = explanation.span_attributes()
    assert attributes["kvmesh.route.lora_name"] == "a" and attributes["kvmesh.route.adapter_resident"] is True


def test_a_base_model_explanation_says_nothing_of_adapters() -> None:
    pool = make_pool(knowing("w0", "a"), knowing("w1", "a"))
    r, registry = lora_router(pool)
    explanation = r.decide(ask("", explain=True)).explanation
    assert explanation is not None
    wire = explanation.to_proto()
    assert wire.lora_name == "" and not any(c.HasField("adapter_resident") for c in wire.candidates)
    assert "lora=" not in route_header(wire) and "adapter=" not in route_header(wire)
    assert "lora" not in explanation.log_line() and "adapter" not in explanation.log_line()
    assert registry.get_sample_value("kvmesh_router_lora_routes_total", {"lora_name": "", "resident": "true"}) is None


def test_round_robin_explains_the_chosen_workers_adapter_too() -> None:
    pool = make_pool(knowing("w0", "a"))
    registry = CollectorRegistry()
    r = Router({RoleName.DECODE: pool}, RouterConfig(mode="round-robin"), RouterMetrics(registry))
    explanation = r.decide(ask("a", explain=True)).explanation
    assert explanation is not None
    header = route_header(explanation.to_proto())
    assert header == f"mode=round-robin lora=a; chosen=w0 adapter=load:{UNREPORTED_LOAD_S:.3f}s kv_source=events"


def test_an_adapter_name_that_would_break_the_header_is_percent_encoded() -> None:
    wire = common_pb2.RouteExplanation(mode="random", lora_name="my adapter;v=2",
                                       candidates=[common_pb2.RouteCandidate(worker_id="w")])
    assert route_header(wire) == "mode=random lora=my%20adapter%3Bv%3D2; chosen=w"


def test_adapter_labels_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(router_metrics, "MAX_ADAPTER_LABELS", 2)
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    for name in ("a", "b", "c", "d", "a"):
        metrics.record_lora(name, resident=True)
    count = registry.get_sample_value
    assert count("kvmesh_router_lora_routes_total", {"lora_name": "a", "resident": "true"}) == 2
    assert count("kvmesh_router_lora_routes_total", {"lora_name": "_other", "resident": "true"}) == 2
    assert count("kvmesh_router_lora_routes_total", {"lora_name": "c", "resident": "true"}) is None


def test_a_worker_whose_slots_are_all_busy_is_charged_the_wait_and_a_doubled_cap() -> None:
    busy = WorkerAdapters()
    busy.observe(worker_pb2.LoadMetrics(max_loras=1, lora_adapters=[
        worker_pb2.LoraAdapterState(lora_name="a", resident=True, active_requests=2),
        worker_pb2.LoraAdapterState(lora_name="b", load_s=0.1)]))
    view = busy.view("b")
    assert view.slots_busy and view.load_s == pytest.approx(0.1 + SLOTS_BUSY_WAIT_S)
    idle = WorkerAdapters()
    idle.observe(worker_pb2.LoadMetrics(max_loras=1, lora_adapters=[
        worker_pb2.LoraAdapterState(lora_name="a", resident=True),
        worker_pb2.LoraAdapterState(lora_name="b", load_s=0.1)]))
    assert not idle.view("b").slots_busy and idle.view("b").load_s == pytest.approx(0.1)
    weights = CostWeights()
    slow = Candidate("busy", 0, 0, 100, 0, 0.0, adapter_load_s=10.0, adapter_slots_busy=True, prompt_prefill_s=0.1)
    cold = Candidate("cold", 0, 0, 100, 0, 0.0, adapter_load_s=10.0, prompt_prefill_s=0.1)
    assert adapter_penalty(slow, 100, weights) == pytest.approx(2 * adapter_penalty(cold, 100, weights))
