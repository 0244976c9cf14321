"""The cost function: 2 * cached share - cache usage - normalized queue, best logit wins."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from services.routing.cost_function import Candidate, CostWeights, choose, logits, overlap_ratio

W = CostWeights()


def cand(wid: str, overlap: int = 0, usage: float = 0.0, waiting: int = 0, **kw) -> Candidate:  # noqa: ANN003
    return Candidate(wid, overlap, int(usage * 1000), 1000, waiting, usage, **kw)


def test_logit_is_twice_the_overlap_ratio_minus_usage_minus_normalized_waiting() -> None:
    cs = [cand("a", overlap=4, usage=0.25, waiting=1), cand("b", usage=0.5, waiting=4)]
    # a: 2 * (4 * 16 / 128) - 0.25 - 1/4 ; b: 0 - 0.5 - 4/4
    assert logits(cs, 16, 128, W) == pytest.approx([0.5, -1.5])


def test_the_worker_caching_the_prefix_wins_when_loads_are_alike() -> None:
    cs = [cand("a", overlap=0), cand("b", overlap=6), cand("c", overlap=2)]
    assert choose(cs, 16, 128, W, random.Random(0)) is cs[1]


def test_a_full_cache_and_the_longest_queue_outweigh_a_small_overlap() -> None:
    cs = [cand("busy", overlap=2, usage=0.95, waiting=10), cand("idle", overlap=0, usage=0.05, waiting=0)]
    assert choose(cs, 16, 128, W, random.Random(0)).worker_id == "idle"


def test_ties_are_broken_at_random() -> None:
    cs = [cand(w) for w in "abcd"]
    rng = random.Random(1)
    picks = Counter(choose(cs, 16, 64, W, rng).worker_id for _ in range(400))
    assert set(picks) == set("abcd") and min(picks.values()) > 50


def test_among_equal_logits_the_worker_caching_the_fewest_blocks_takes_a_new_prefix() -> None:
    cs = [cand("full", indexed_blocks=900), cand("empty", indexed_blocks=10), cand("half", indexed_blocks=400)]
    assert {choose(cs, 16, 64, W, random.Random(s)).worker_id for s in range(20)} == {"empty"}


def test_requests_the_router_just_sent_count_as_load_until_the_worker_reports() -> None:
    fresh = cand("fresh")
    swamped = cand("swamped", pending_requests=5, pending_blocks=300)
    assert swamped.waiting() == 5 and swamped.cache_usage() == pytest.approx(0.3)
    assert choose([swamped, fresh], 16, 64, W, random.Random(0)).worker_id == "fresh"


def test_temperature_samples_in_proportion_to_softmax_of_the_logits() -> None:
    cs = [cand("a", overlap=4), cand("b", overlap=0)]
    hot = CostWeights(temperature=1.0)
    rng = random.Random(2)
    picks = Counter(choose(cs, 16, 64, hot, rng).worker_id for _ in range(2000))
    # logits 2.0 and 0.0: P(a) = e^2 / (e^2 + 1) ~ 0.88
    assert 0.84 < picks["a"] / 2000 < 0.92


def test_the_overlap_ratio_is_the_cached_share_of_the_prompt_and_none_of_an_empty_one() -> None:
    assert overlap_ratio(6, 16, 128) == pytest.approx(6 * 16 / 128)
    assert overlap_ratio(9, 16, 128) == 1.0  # a partial last block cached whole: never above all of it
    assert overlap_ratio(3, 16, 0) == 0.0
