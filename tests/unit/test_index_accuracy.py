"""The router's index accuracy (services/routing/index_accuracy.py): the predicted tokens and
their cap per engine, the per-request ratio and error, the recent mean, the bounded memory of
predictions, and the router's `report` from a decision to its metrics and explanation.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from gen.kvmesh.v1 import common_pb2, router_pb2
from services.contract.worker_roles import RoleName
from services.frontend.route_header import route_header
from services.routing.config import RouterConfig
from services.routing import kv_source
from services.routing.index_accuracy import IndexAccuracy, RecentPredictions, Sample, reusable_tokens
from services.routing.route_query import RouteQuery
from services.routing.router import Router
from services.routing.router_metrics import RouterMetrics
from services.routing.servicer import RouterServicer
from services.mesh.session_kind import CallInfo
from tests.unit.test_router_route import BS, MODEL, PROMPT, cache, info, make_pool, view_of

# -- the predicted tokens -----------------------------------------------------------------------


@pytest.mark.parametrize(("blocks", "prompt", "engine", "expected"), [
    # The mocker reuses every full block it holds: a fully cached 4-block prompt is all cached.
    (4, 64, "mocker", 64),
    (4, 67, "mocker", 64),
    (2, 67, "mocker", 32),
    (0, 67, "mocker", 0),
    # vLLM computes the last token for its logits: the block holding it is recomputed.
    (4, 64, "vllm", 48),
    (4, 65, "vllm", 64),
    (4, 67, "vllm", 64),
    (2, 67, "vllm", 32),
    (1, 16, "vllm", 0),
    (0, 1, "vllm", 0),
    # An engine the table does not name is taken at its blocks.
    (4, 64, "", 64),
])
def test_the_prediction_is_the_matched_blocks_capped_as_the_engine_caps(blocks: int, prompt: int, engine: str,
                                                                        expected: int) -> None:
    assert reusable_tokens(blocks, 16, prompt, engine) == expected


@pytest.mark.parametrize(("predicted", "cached", "ratio", "error"), [
    (0, 0, 1.0, 0),  # nothing predicted, nothing found: right
    (64, 64, 1.0, 0),
    (48, 64, 0.75, 16),
    (64, 48, 0.75, 16),
    (64, 0, 0.0, 64),
    (0, 32, 0.0, 32),
])
def test_a_samples_ratio_is_the_smaller_over_the_larger_and_its_error_the_difference(
        predicted: int, cached: int, ratio: float, error: int) -> None:
    sample = Sample(predicted, cached)
    assert (sample.ratio, sample.error_tokens) == (pytest.approx(ratio), error)


# -- the recent accuracy ------------------------------------------------------------------------


def test_the_recent_accuracy_is_the_mean_ratio_of_the_last_samples() -> None:
    accuracy = IndexAccuracy(window=4)
    assert accuracy.recent("w") is None and accuracy.samples("w") == ()
    for predicted, cached in ((16, 16), (16, 32), (48, 64), (64, 0)):  # ratios 1, 0.5, 0.75, 0
        accuracy.observe("w", predicted, cached)
    assert accuracy.recent("w") == pytest.approx(2.25 / 4)
    accuracy.observe("w", 16, 64)  # 0.25; the first sample (1.0) leaves the window
    assert accuracy.recent("w") == pytest.approx(1.5 / 4)
    assert [s.ratio for s in accuracy.samples("w")] == [0.5, 0.75, 0.0, 0.25]
    assert accuracy.recent("other") is None


def test_a_forgotten_worker_starts_again_from_no_sample() -> None:
    accuracy = IndexAccuracy()
    accuracy.observe("w", 0, 64)
    accuracy.forget("w")
    accuracy.forget("never-seen")
    assert accuracy.recent("w") is None and accuracy.samples("w") == ()
    accuracy.observe("w", 64, 64)
    assert accuracy.recent("w") == 1.0


def test_the_recent_mean_stays_within_0_and_1_over_many_samples() -> None:
    accuracy = IndexAccuracy(window=3)
    for i in range(1000):
        accuracy.observe("w", i % 7, (i * 3) % 11)
    expected = sum(s.ratio for s in accuracy.samples("w")) / 3
    assert accuracy.recent("w") == pytest.approx(expected) and 0.0 <= expected <= 1.0


# -- the predictions waiting for their feedback --------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_prediction_is_taken_once() -> None:
    predictions = RecentPredictions()
    predictions.remember("r", "w", 48, 67)
    assert predictions.take("r", "other") is None
    taken = predictions.take("r", "w")
    assert taken is not None and (taken.predicted_tokens, taken.prompt_tokens) == (48, 67)
    assert predictions.take("r", "w") is None


def test_predictions_are_bounded_by_count_and_age_the_oldest_going_first() -> None:
    clock = Clock()
    predictions = RecentPredictions(max_entries=3, ttl_s=10.0, clock=clock)
    for i in range(4):
        predictions.remember(f"r{i}", "w", i, 100)
    assert len(predictions) == 3 and predictions.take("r0", "w") is None
    clock.now = 5.0
    predictions.remember("r1", "w", 7, 100)  # routed there again: the newer one, the youngest
    clock.now = 12.0
    predictions.remember("r4", "w", 4, 100)  # r2 and r3 (t=0) are past the 10 s
    assert len(predictions) == 2
    assert predictions.take("r2", "w") is None and predictions.take("r3", "w") is None
    r1 = predictions.take("r1", "w")
    assert r1 is not None and r1.predicted_tokens == 7
    clock.now = 30.0
    assert predictions.take("r4", "w") is None  # expired, though nothing was remembered since


# -- the router: a decision, its feedback, the metrics and the explanation -----------------------

LONGER = PROMPT + list(range(900, 900 + 3))  # PROMPT's four full blocks (BS=4) and three more tokens


def make_router(*workers: str, engine: str = "mocker") -> tuple[Router, CollectorRegistry]:
    pool = make_pool(*(replace(info(w), engine=engine) for w in workers))
    registry = CollectorRegistry()
    return Router({RoleName.DECODE: pool}, RouterConfig(seed=0), RouterMetrics(registry)), registry


def accuracy(router: Router) -> IndexAccuracy:
    """The decode pool's index accuracy (the pool owns it; the router records it)."""
    return router._pools[RoleName.DECODE].accuracy


def value(registry: CollectorRegistry, name: str, worker: str) -> float | None:
    return registry.get_sample_value(name, {"worker_id": worker})


def test_a_report_compares_the_engines_count_with_the_decisions_prediction() -> None:
    router, registry = make_router("a")
    cache(router._pools[RoleName.DECODE], "a", PROMPT[:3 * BS])  # 3 of the 4 full blocks
    route = router.decide(RouteQuery("r1", MODEL, LONGER))
    assert (route.worker_id, route.overlap_blocks) == ("a", 3)
    router.report("r1", "a", cached_tokens=4 * BS, prompt_tokens=len(LONGER))  # the engine had all four
    # predicted 12, found 16: ratio 12/16, error 4.
    assert accuracy(router).recent("a") == pytest.approx(0.75)
    assert value(registry, "kvmesh_router_index_accuracy_ratio_sum", "a") == pytest.approx(0.75)
    assert value(registry, "kvmesh_router_index_accuracy_ratio_count", "a") == 1
    assert value(registry, "kvmesh_router_index_error_tokens_sum", "a") == 4
    assert registry.get_sample_value("kvmesh_router_index_error_tokens_bucket", {"worker_id": "a", "le": "0.0"}) == 0
    assert value(registry, "kvmesh_router_index_recent_accuracy", "a") == pytest.approx(0.75)
    # Reported twice (another choice of the request): the prediction was taken by the first.
    router.report("r1", "a", cached_tokens=0, prompt_tokens=len(LONGER))
    assert value(registry, "kvmesh_router_index_accuracy_ratio_count", "a") == 1


def test_a_vllm_workers_fully_cached_prompt_is_predicted_without_its_last_block() -> None:
    router, _ = make_router("a", engine="vllm")
    cache(router._pools[RoleName.DECODE], "a", PROMPT)  # the whole 16-token prompt
    router.decide(RouteQuery("r1", MODEL, PROMPT))
    router.report("r1", "a", cached_tokens=3 * BS, prompt_tokens=len(PROMPT))  # what vLLM reports
    assert accuracy(router).samples("a") == (Sample(3 * BS, 3 * BS),)


def test_reports_with_no_matching_prediction_are_ignored() -> None:
    router, registry = make_router("a")
    router.decide(RouteQuery("r1", MODEL, LONGER))
    router.report("unknown", "a", 16)
    router.report("r1", "b", 16)  # not the worker it chose
    router.report("r1", "a", 16, prompt_tokens=len(LONGER) + 5)  # resumed with tokens never routed
    assert accuracy(router).recent("a") is None
    assert value(registry, "kvmesh_router_index_accuracy_ratio_count", "a") is None


def test_the_prefill_pools_decisions_remember_nothing() -> None:
    decode, prefill = make_pool(info("d")), make_pool(info("p"))
    router = Router({RoleName.DECODE: decode, RoleName.PREFILL: prefill}, RouterConfig(), RouterMetrics(CollectorRegistry()))
    router.decide(RouteQuery("r1", MODEL, PROMPT, RoleName.PREFILL))
    router.report("r1", "p", 0)
    assert prefill.accuracy.recent("p") is None


def test_a_worker_that_leaves_its_pool_is_forgotten_with_its_series() -> None:
    router, registry = make_router("a", "b")
    for rid in ("r1", "r2"):
        wid = router.decide(RouteQuery(rid, MODEL, LONGER)).worker_id
        router.report(rid, wid, 0, len(LONGER))
    left = router.decide(RouteQuery("r3", MODEL, LONGER)).worker_id
    router.report("r3", left, 0, len(LONGER))
    assert accuracy(router).recent(left) == 1.0
    view_of(router._pools[RoleName.DECODE]).announce(left, None)
    assert accuracy(router).recent(left) is None
    assert value(registry, "kvmesh_router_index_recent_accuracy", left) is None
    assert value(registry, "kvmesh_router_index_accuracy_ratio_count", left) is None


def test_a_report_that_comes_after_its_worker_left_brings_no_series_back() -> None:
    router, registry = make_router("a")
    router.decide(RouteQuery("r1", MODEL, LONGER))
    view_of(router._pools[RoleName.DECODE]).announce("a", None)  # draining: it left before its first output
    router.report("r1", "a", 0, len(LONGER))
    assert accuracy(router).recent("a") is None
    assert value(registry, "kvmesh_router_index_accuracy_ratio_count", "a") is None
    assert value(registry, "kvmesh_router_index_recent_accuracy", "a") is None


def test_a_predicted_workers_reports_judge_its_index_not_the_accuracy_of_its_events() -> None:
    router, registry = make_router("a")
    pool = router._pools[RoleName.DECODE]
    cache(pool, "a", PROMPT)  # the index says all four blocks
    pool._sources.add("a", publishes=True)  # what following its streams does (admit() follows nothing)
    pool._sources.evaluate("a", 0.0)  # found inaccurate: predicted, its index to be judged again
    assert pool.kv_source("a") == "predicted" and accuracy(router).recent("a") is None
    for i in range(kv_source.AGREEMENT_SAMPLES):
        rid = f"r{i}"
        router.decide(RouteQuery(rid, MODEL, LONGER))
        router.report(rid, "a", 4 * BS, len(LONGER))  # the engine had what the index said
    # Counted in the histograms (what the router believed: the prediction), not in its index's accuracy.
    assert value(registry, "kvmesh_router_index_accuracy_ratio_count", "a") == kv_source.AGREEMENT_SAMPLES
    assert accuracy(router).recent("a") is None
    assert pool._sources.evaluate("a", None) == "agreeing" and pool.kv_source("a") == "events"


def test_the_explanation_tells_each_candidates_kv_source_and_recent_accuracy() -> None:
    router, _ = make_router("a", "b")
    cache(router._pools[RoleName.DECODE], "a", PROMPT)
    router.decide(RouteQuery("r1", MODEL, LONGER))
    router.report("r1", "a", 2 * BS, len(LONGER))  # predicted 16, found 8: 0.5
    route = router.decide(RouteQuery("r2", MODEL, LONGER, explain=True))
    assert route.explanation is not None
    wire = route.explanation.to_proto()
    a, b = wire.candidates
    assert (a.worker_id, a.kv_source, a.recent_accuracy) == ("a", common_pb2.RouteCandidate.KV_SOURCE_EVENTS, 0.5)
    assert (b.worker_id, b.kv_source, b.HasField("recent_accuracy")) == ("b", common_pb2.RouteCandidate.KV_SOURCE_EVENTS,
                                                                         False)
    assert route.explanation.log_line().startswith("kv mode chose a among 2: a overlap=4 ")
    assert " kv_source=events accuracy=0.500, b overlap=0 " in route.explanation.log_line()
    assert route.explanation.log_line().endswith(" kv_source=events")
    header = route_header(wire)
    assert "chosen=a overlap=4 " in header and header.split("; ")[1].endswith(" kv_source=events accuracy=0.500")
    assert header.split("; ")[2].startswith("runner-up=b ") and header.endswith(" kv_source=events")


def test_the_header_leaves_out_what_the_router_did_not_say() -> None:
    rr = common_pb2.RouteExplanation(mode="round-robin", candidates=[common_pb2.RouteCandidate(
        worker_id="w1", kv_source=common_pb2.RouteCandidate.KV_SOURCE_PREDICTED, recent_accuracy=0.25)])
    assert route_header(rr) == "mode=round-robin; chosen=w1 kv_source=predicted accuracy=0.250"
    old = common_pb2.RouteExplanation(mode="round-robin", candidates=[common_pb2.RouteCandidate(worker_id="w1")])
    assert route_header(old) == "mode=round-robin; chosen=w1"


# -- the wire: feedback riding on a session's call -----------------------------------------------


async def test_the_servicer_takes_feedback_before_the_calls_own_decision_and_alone() -> None:
    router, registry = make_router("a")
    servicer = RouterServicer(router)
    router.decide(RouteQuery("r1", MODEL, LONGER))
    feedback = router_pb2.RouteFeedback(request_id="r1", worker_id="a", cached_tokens=0, prompt_tokens=len(LONGER))
    # Feedback alone: no reply, and the call ends.
    assert [r async for r in servicer.route(router_pb2.RouteRequest(feedback=[feedback]), CallInfo({}))] == []
    assert accuracy(router).recent("a") == 1.0
    # Feedback on a call of its own: taken before the decision, so the explanation has it.
    router.decide(RouteQuery("r2", MODEL, LONGER))
    request = router_pb2.RouteRequest(request_id="r3", model=MODEL, token_ids=LONGER, explain=True, feedback=[
        router_pb2.RouteFeedback(request_id="r2", worker_id="a", cached_tokens=8, prompt_tokens=len(LONGER))])
    (reply,) = [r async for r in servicer.route(request, CallInfo({}))]
    assert reply.worker_id == "a" and reply.explanation.candidates[0].recent_accuracy == pytest.approx(0.5)
    assert value(registry, "kvmesh_router_index_accuracy_ratio_count", "a") == 2
