"""The planner's model and decision, in-process: predictions, calibration of the profile's
scale, sizing with hysteresis and cool-down, and the split of a fixed budget."""

from __future__ import annotations

import math

import pytest

from services.config_error import ConfigError
from services.planner.flags import profile_cost
from services.planner.model import Calibration, Scales, Traffic, predict
from services.planner.policy import Limits, Policy, Slo
from services.planner.pools import PoolSizes
from services.profiles.cost_model import CostModel

PROFILE = profile_cost("large-gpu-8b", 1.0)
SLO = Slo(ttft_s=0.5, itl_s=0.02)
PREFILL_HEAVY = Traffic(rate_per_s=18.0, mean_input_tokens=6000, mean_output_tokens=20, remote_share=1.0)
DECODE_HEAVY = Traffic(rate_per_s=12.0, mean_input_tokens=200, mean_output_tokens=1500, remote_share=0.0)
ONE = Scales()


def ttft(traffic: Traffic, prefill: int, decode: int = 2, scales: Scales = ONE) -> float:
    return predict(PROFILE, scales, traffic, prefill, decode).ttft_s


def itl(traffic: Traffic, decode: int, prefill: int = 1, scales: Scales = ONE) -> float:
    return predict(PROFILE, scales, traffic, prefill, decode).itl_s


def test_remote_prefill_follows_the_queue_and_saturates() -> None:
    t = PROFILE.prefill_s(6000)
    assert ttft(Traffic(0, 6000, 10, remote_share=1.0), 1) == pytest.approx(t)  # idle: the prefill alone
    light = Traffic(1.0, 6000, 10, remote_share=1.0)
    assert t < ttft(light, 2) < ttft(light, 1)
    # Past what batching can absorb (rate x the prompts' own cost >= 1 per worker): unbounded.
    assert ttft(Traffic(1.01 / PROFILE.prompt_s(6000), 6000, 10, remote_share=1.0), 1) == math.inf
    assert ttft(light, 0) < math.inf  # no prefill pool: every prompt is prefilled where it is decoded


def test_batching_keeps_a_pool_past_one_prompt_at_a_time_unsaturated() -> None:
    """Prompts arriving faster than one prefill each finishes still get through: waiting ones
    share a step's base."""
    t, q = PROFILE.prefill_s(512), PROFILE.prompt_s(512)
    rate = 1.2 / t  # rho 1.2 one prompt at a time; rate x q < 1
    assert rate * q < 1
    assert ttft(Traffic(rate, 512, 8, remote_share=1.0), 1) < math.inf


def test_decode_prediction_follows_the_batch_and_the_local_prefills() -> None:
    assert itl(Traffic(0, 100, 100), 1) == pytest.approx(PROFILE.decode_base_s)
    # 12 req/s x 1500 tokens over 2 workers: 9000 tokens/s each; a step of a / (1 - b x), plus the
    # local prompts' share of the time and of the prefill base.
    no_local = Traffic(12.0, 200, 1500, remote_share=1.0)
    assert itl(no_local, 2) == pytest.approx(PROFILE.decode_base_s / (1 - PROFILE.decode_per_seq_s * 9000))
    assert itl(DECODE_HEAVY, 2) > itl(no_local, 2)
    assert itl(DECODE_HEAVY, 3) < itl(DECODE_HEAVY, 2)
    assert itl(Traffic(1000, 10, 1000), 1) == math.inf


def test_a_context_term_slows_long_sequences() -> None:
    costly = CostModel(**(PROFILE.to_dict() | {"decode_per_context_token_s": 1e-8}))
    # Prompts prefilled remotely: only the decode steps are on the decode workers.
    short, long = Traffic(12.0, 200, 500, remote_share=1.0), Traffic(12.0, 8000, 500, remote_share=1.0)
    assert predict(costly, ONE, long, 1, 4).itl_s > predict(costly, ONE, short, 1, 4).itl_s
    assert predict(PROFILE, ONE, long, 1, 4).itl_s == predict(PROFILE, ONE, short, 1, 4).itl_s


@pytest.mark.parametrize("factor", [0.5, 2.0, 3.0])
def test_calibration_finds_how_far_off_the_profile_is(factor: float) -> None:
    """The mesh runs `factor` x slower than the profile says: the scales converge on it."""
    truth = Scales(factor, factor)
    traffic = Traffic(6.0, 3000, 200, remote_share=0.5, remote_prompt_tokens=5800, local_prompt_tokens=200)
    real = predict(PROFILE, truth, traffic, 2, 3)
    observed = Traffic(**(traffic.__dict__ | {"observed_ttft_s": real.ttft_s, "observed_itl_s": real.itl_s}))
    c = Calibration()
    for _ in range(12):
        c.update(PROFILE, observed, 2, 3)
    assert c.scales.decode == pytest.approx(factor, rel=0.01)
    assert c.scales.prefill == pytest.approx(factor, rel=0.01)
    # Then the model predicts another split as the slower mesh would run it.
    assert predict(PROFILE, c.scales, traffic, 3, 2).ttft_s == pytest.approx(predict(PROFILE, truth, traffic, 3, 2).ttft_s,
                                                                             rel=0.02)


def test_the_first_measurement_is_taken_whole_and_later_ones_smoothed() -> None:
    traffic = Traffic(6.0, 3000, 200, remote_share=0.5, remote_prompt_tokens=5800, local_prompt_tokens=200)

    def observed(factor: float) -> Traffic:
        real = predict(PROFILE, Scales(factor, factor), traffic, 2, 3)
        return Traffic(**(traffic.__dict__ | {"observed_ttft_s": real.ttft_s, "observed_itl_s": real.itl_s}))

    c = Calibration()
    c.update(PROFILE, observed(2.0), 2, 3)
    assert c.scales.decode == pytest.approx(2.0, rel=0.01) and c.scales.prefill == pytest.approx(2.0, rel=0.01)
    c.update(PROFILE, observed(4.0), 2, 3)  # one odd interval moves it part of the way
    assert 2.2 < c.scales.decode < 3.8


def test_calibration_skips_what_it_cannot_learn_from() -> None:
    c = Calibration()
    # Nothing went to the prefill pool: a TTFT says nothing about it.
    c.update(PROFILE, Traffic(6.0, 64, 64, observed_ttft_s=5.0, observed_itl_s=None, remote_share=0.0), 2, 3)
    assert c.scales == Scales()
    # The model calls the pool saturated: the latency of what got through is no measure either.
    c.update(PROFILE, Traffic(1000, 10, 1000, observed_itl_s=0.05, remote_share=0.0), 1, 1)
    assert c.scales == Scales()
    # A wild observation is bounded by the range a calibration may find.
    for _ in range(30):
        c.update(PROFILE, Traffic(1.0, 200, 200, observed_itl_s=1e6, remote_share=0.0), 1, 1)
    assert c.scales.decode <= 20.0


def test_sized_pools_grow_at_once_and_shrink_with_headroom() -> None:
    policy = Policy(PROFILE, SLO, Limits(cooldown_s=0))
    up = policy.decide(0, PoolSizes(1, 1), PREFILL_HEAVY)
    assert up.desired.prefill > 1
    assert up.predicted_ttft_s <= SLO.ttft_s
    assert up.desired.prefill - 1 == 0 or ttft(PREFILL_HEAVY, up.desired.prefill - 1, up.desired.decode) > SLO.ttft_s
    # The same load again: nothing moves.
    assert policy.decide(1, up.desired, PREFILL_HEAVY).desired == up.desired
    # Load just under what one fewer worker handles, but without headroom: the size holds.
    n = up.desired.prefill
    edge = PREFILL_HEAVY
    while ttft(edge, n - 1, up.desired.decode) > SLO.ttft_s:
        edge = Traffic(edge.rate_per_s * 0.97, edge.mean_input_tokens, edge.mean_output_tokens, remote_share=1.0)
    if ttft(edge, n - 1, up.desired.decode) > Limits().headroom * SLO.ttft_s:
        assert policy.decide(2, up.desired, edge).desired.prefill == n
    # The burst is over: it shrinks to the floor of one worker while traffic remains.
    quiet = Traffic(0.2, 300, 20)
    assert policy.decide(3, up.desired, quiet).desired == PoolSizes(1, 1)


def test_cool_down_holds_a_pool_that_just_changed() -> None:
    policy = Policy(PROFILE, SLO, Limits(cooldown_s=30))
    first = policy.decide(100, PoolSizes(1, 1), PREFILL_HEAVY)
    assert first.desired.prefill > 1
    held = policy.decide(110, first.desired, Traffic(0.2, 300, 20))
    assert held.desired.prefill == first.desired.prefill
    assert "cooling down" in held.reason
    assert policy.decide(131, first.desired, Traffic(0.2, 300, 20)).desired.prefill == 1


def test_no_traffic_lets_an_optional_pool_go_to_zero_but_never_below_one_with_traffic() -> None:
    policy = Policy(PROFILE, SLO, Limits(min_prefill=0, cooldown_s=0))
    assert policy.decide(0, PoolSizes(2, 2), Traffic(0, 0, 0)).desired == PoolSizes(0, 1)
    assert policy.decide(1, PoolSizes(0, 1), Traffic(0.1, 100, 10)).desired.prefill == 1


def test_a_fixed_budget_follows_the_phase() -> None:
    policy = Policy(PROFILE, SLO, Limits(total=6, cooldown_s=0))
    prefill_phase = policy.decide(0, PoolSizes(3, 3), PREFILL_HEAVY)
    assert prefill_phase.desired.total == 6 and prefill_phase.desired.prefill > 3
    decode_phase = policy.decide(1, prefill_phase.desired, DECODE_HEAVY)
    assert decode_phase.desired.total == 6 and decode_phase.desired.decode > 3
    # Asked again at the same load, it keeps the split it chose.
    assert policy.decide(2, decode_phase.desired, DECODE_HEAVY).desired == decode_phase.desired


def test_a_fixed_budget_switches_only_for_a_clear_gain() -> None:
    policy = Policy(PROFILE, SLO, Limits(total=6, cooldown_s=0, switch_gain=0.8))
    light = Traffic(0.5, 1000, 100)
    decision = policy.decide(0, PoolSizes(3, 3), light)
    assert decision.desired == PoolSizes(3, 3)
    assert "margin" in decision.reason


@pytest.mark.parametrize("kwargs, flag", [
    ({"min_prefill": 3, "max_prefill": 2}, "--min-prefill-workers"),
    ({"min_decode": 0}, "--min-decode-workers"),
    ({"total": 1}, "--total-workers"),
    ({"cooldown_s": -1}, "--cooldown"),
    ({"headroom": 0}, "--scale-down-headroom"),
    ({"switch_gain": 1.5}, "--switch-gain"),
])
def test_limits_name_the_bad_flag(kwargs: dict, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        Limits(**kwargs)


def test_slo_and_profile_validate() -> None:
    with pytest.raises(ConfigError, match="--ttft-slo-ms"):
        Slo(0, 1)
    with pytest.raises(ConfigError, match="--profile: no profile 'no-such-gpu'"):
        profile_cost("no-such-gpu", 1.0)
    with pytest.raises(ConfigError, match="--profile-speedup"):
        profile_cost("h100-8b", math.inf)


def test_a_role_that_is_neither_prefill_nor_decode_is_an_error_not_the_decode_pool() -> None:
    with pytest.raises(ValueError, match="unknown worker role 'decdoe'"):
        PoolSizes(1, 2).of("decdoe")
    with pytest.raises(ValueError, match="unknown worker role"):
        PoolSizes(1, 2).with_role("router", 3)
    assert PoolSizes(1, 2).with_role("prefill", 3) == PoolSizes(3, 2)


def test_requests_waiting_in_the_routers_queues_grow_the_decode_pool_by_one() -> None:
    from dataclasses import replace

    from services.planner.traffic import parse_queue

    policy = Policy(PROFILE, Slo(ttft_s=10.0, itl_s=10.0), Limits(max_decode=3, cooldown_s=0))
    quiet = Traffic(rate_per_s=1.0, mean_input_tokens=100, mean_output_tokens=10)
    assert policy.decide(0.0, PoolSizes(1, 2), quiet).desired.decode == 1  # the SLOs alone: shrink
    waiting = replace(quiet, queued=12, queue_wait_s=0.4)
    decision = policy.decide(1.0, PoolSizes(1, 2), waiting)
    assert decision.desired.decode == 3 and "12 requests wait" in decision.reason
    assert policy.decide(2.0, PoolSizes(1, 3), waiting).desired.decode == 3  # at its maximum
    text = ("# TYPE kvmesh_admission_queued gauge\nkvmesh_admission_queued 12.0\n"
            "# TYPE kvmesh_admission_predicted_wait_seconds gauge\nkvmesh_admission_predicted_wait_seconds 0.4\n")
    assert parse_queue(text) == (12.0, 0.4)
