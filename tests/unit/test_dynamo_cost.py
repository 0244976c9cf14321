"""NVIDIA Dynamo's cost (`--cost-model dynamo`): prefill_load_scale * adjusted prefill blocks + decode
blocks, the lowest wins. Cases worked by hand at block size 16 and a 128-token prompt (8 blocks)."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from gen.kvmesh.v1 import worker_pb2
from services.config_error import ConfigError
from services.routing import dynamo_cost
from services.routing.config import RouterConfig
from services.routing.cost_function import COST_MODELS, Candidate, CostModel, CostWeights, ranked
from services.routing.dynamo_cost import DynamoCostConfig, breakdown, choose, costs, pick_index, terms
from services.routing.pickers import PickContext, make_picker
from services.routing.worker_pool import WorkerState
from tests.unit.test_router_route import info

BS, TOKENS = 16, 128
DEFAULT = DynamoCostConfig()


def cand(wid: str, overlap: int = 0, active: int = 0, waiting: int = 0, running: int = 0, **kw: Any) -> Candidate:
    return Candidate(wid, overlap, active, 1000, waiting, active / 1000, num_requests_running=running, **kw)


def test_an_idle_worker_costs_the_prompt_once_to_prefill_and_once_to_hold() -> None:
    assert costs([cand("idle")], BS, TOKENS, DEFAULT) == [8 + 8]
    assert costs([cand("idle")], BS, 120, DEFAULT) == [pytest.approx(7.5 + 7.5)]  # a partial block counts in part


def test_a_loaded_worker_pays_its_queued_prefill_and_active_blocks() -> None:
    # 4 blocks cached; 3 pending blocks; 1 waiting request at 10 active / 2 running = 5 blocks.
    # adjusted prefill = 3 + 5 + 8 - 4 = 12; decode = 10 + 3 + (8 - 4) = 17.
    c = cand("a", overlap=4, active=10, waiting=1, running=2, pending_requests=1, pending_blocks=3)
    b = breakdown(c, BS, TOKENS, DEFAULT)
    assert (b.adjusted_prefill_blocks, b.decode_blocks, b.cost) == (12, 17, 29)
    assert breakdown(c, BS, TOKENS, DynamoCostConfig(prefill_load_scale=2)).cost == 2 * 12 + 17


def test_a_waiting_request_on_a_worker_running_none_counts_as_this_prompt() -> None:
    assert breakdown(cand("w", waiting=2), BS, TOKENS, DEFAULT).adjusted_prefill_blocks == 2 * 8 + 8


def test_each_tier_is_credited_at_its_own_weight() -> None:
    # 2 device blocks at 1, 4 host blocks at 0.75: 8 - 2 - 3 = 3 to prefill; 8 - 2 = 6 to hold.
    c = cand("h", overlap=2, host_overlap_blocks=4)
    assert breakdown(c, BS, TOKENS, DEFAULT).cost == 3 + 6
    assert breakdown(c, BS, TOKENS, DynamoCostConfig(host_cache_hit_weight=0)).cost == 6 + 6
    assert breakdown(c, BS, TOKENS, DynamoCostConfig(overlap_score_credit=0.5)).cost == 8 - 1 - 3 + 6


def test_adjusted_prefill_never_goes_below_zero() -> None:
    c = cand("hot", overlap=6)
    assert breakdown(c, BS, TOKENS, DynamoCostConfig(overlap_score_credit=2)).cost == 0 + 2


def test_temperature_zero_picks_the_lowest_cost() -> None:
    cs = [cand("busy", overlap=6, active=40, running=4), cand("cached", overlap=6), cand("cold")]
    assert [round(c) for c in costs(cs, BS, TOKENS, DEFAULT)] == [44, 4, 16]
    assert {choose(cs, BS, TOKENS, DEFAULT, 0.0, random.Random(s)).worker_id for s in range(20)} == {"cached"}


def test_a_cached_prefix_loses_to_a_cold_worker_once_its_load_outweighs_it() -> None:
    # cached: 2 + 2 to prefill and hold, plus 20 active; cold: 8 + 8.
    cs = [cand("cached", overlap=6, active=20, running=1), cand("cold")]
    assert choose(cs, BS, TOKENS, DEFAULT, 0.0, random.Random(0)).worker_id == "cold"


def test_exact_ties_are_broken_at_random() -> None:
    cs = [cand(w) for w in "abcd"]
    rng = random.Random(1)
    picks = Counter(choose(cs, BS, TOKENS, DEFAULT, 0.0, rng).worker_id for _ in range(400))
    assert set(picks) == set("abcd") and min(picks.values()) > 50


def test_temperature_samples_softmax_of_the_costs_scaled_onto_zero_to_one() -> None:
    # Scaled costs 0 and 1 whatever their size: P(low) = 1 / (1 + e^-1) ~ 0.73 at T = 1.
    rng = random.Random(2)
    picks = Counter(pick_index([100.0, 5000.0], 1.0, rng) for _ in range(2000))
    assert 0.69 < picks[0] / 2000 < 0.77
    assert Counter(pick_index([7.0, 7.0], 1.0, rng) for _ in range(400))[0] > 150  # equal: uniform


def test_the_explanation_ranks_by_negated_cost() -> None:
    cs = [cand("cold"), cand("cached", overlap=6), cand("busy", overlap=6, active=40, running=4)]
    all_terms = terms(cs, BS, TOKENS, DEFAULT)
    assert [t.logit for t in all_terms] == [-c for c in costs(cs, BS, TOKENS, DEFAULT)]
    assert [t.worker_id for t in ranked(all_terms, "cached")] == ["cached", "cold", "busy"]


def worker(wid: str, **load: int) -> WorkerState:
    return WorkerState(info(wid), worker_pb2.LoadMetrics(kv_total_blocks=1000, **load))


def test_the_kv_picker_scores_with_the_configured_model() -> None:
    # "cached" holds 6 of 8 blocks but runs 40; the cached-share rule weighs usage (0.04) lightly and takes it,
    # Dynamo counts its 40 active blocks and takes the idle one.
    workers = [worker("cached", kv_active_blocks=40, request_active_slots=4), worker("idle")]
    context = PickContext({"cached": 6}, BS, TOKENS, lambda _: 0)
    cached_share = make_picker("kv", random.Random(0), CostWeights())
    dynamo = make_picker("kv", random.Random(0), CostWeights(model=CostModel.DYNAMO))
    assert cached_share.pick(workers, context).info.instance_id == "cached"
    assert dynamo.pick(workers, context).info.instance_id == "idle"
    assert [t.logit for t in dynamo.terms(workers, context)] == [-(2 + 40 + 2), -(8 + 8)]


def test_the_host_overlap_weight_flag_is_the_dynamo_host_weight_too() -> None:
    workers = [worker("h")]
    context = PickContext({}, BS, TOKENS, lambda _: 0, host_overlaps={"h": 8})
    fixed = make_picker("kv", random.Random(0), CostWeights(model=CostModel.DYNAMO, host_overlap=0.5))
    assert [(t.logit, t.host_credit) for t in fixed.terms(workers, context)] == [(-(4 + 8), 0.5)]
    default = make_picker("kv", random.Random(0), CostWeights(model=CostModel.DYNAMO))
    assert [t.host_credit for t in default.terms(workers, context)] == [0.75]


def test_the_prefill_load_scale_setting_reaches_the_dynamo_rule() -> None:
    workers = [worker("w")]
    context = PickContext({}, BS, TOKENS, lambda _: 0)
    scaled = make_picker("kv", random.Random(0), CostWeights(model=CostModel.DYNAMO, prefill_load_scale=3))
    assert [t.logit for t in scaled.terms(workers, context)] == [-(3 * 8 + 8)]


@pytest.mark.parametrize(("build", "flag"), [
    (lambda: CostWeights(model="lmetric"), "--cost-model"),  # type: ignore[arg-type]
    # The flag's string is converted where it is parsed: a bare string is not a model, even a known one.
    (lambda: CostWeights(model="dynamo"), "--cost-model"),  # type: ignore[arg-type]
    (lambda: CostWeights(prefill_load_scale=-1), "--prefill-load-scale"),
    (lambda: CostWeights(prefill_load_scale=float("inf")), "--prefill-load-scale"),
    (lambda: DynamoCostConfig(prefill_load_scale=float("nan")), "--prefill-load-scale"),
    (lambda: DynamoCostConfig(overlap_score_credit=float("inf")), "overlap_score_credit"),
    (lambda: DynamoCostConfig(host_cache_hit_weight=1.5), "host_cache_hit_weight"),
])
def test_a_bad_cost_model_setting_names_its_flag(build: Any, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        build()


def test_the_cached_share_model_is_the_default() -> None:
    assert RouterConfig().cost_model is CostModel.CACHED_SHARE and dynamo_cost.DynamoCostConfig() == DEFAULT


def test_the_cost_model_flag_offers_each_model_by_its_name() -> None:
    import argparse

    from services.routing.flags import add_router_flags, router_config

    assert COST_MODELS == ("cached-share", "dynamo")
    parser = argparse.ArgumentParser()
    add_router_flags(parser)
    for name in COST_MODELS:
        assert router_config(parser.parse_args(["--cost-model", name])).cost_model is CostModel(name)
    assert router_config(parser.parse_args([])).cost_model is CostModel.CACHED_SHARE
