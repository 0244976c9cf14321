"""The planner's model and decision, in-process: predictions, corrections, sizing with
hysteresis and cool-down, and the split of a fixed budget."""

from __future__ import annotations

import math

import pytest

from services.mesh.config_error import ConfigError
from services.planner.model import Corrections, Traffic, WorkerProfile, raw_itl_s, raw_ttft_s
from services.planner.policy import Limits, Policy, Slo
from services.planner.pools import PoolSizes

PROFILE = WorkerProfile.preset("large-gpu-8b")
SLO = Slo(ttft_s=0.5, itl_s=0.02)
PREFILL_HEAVY = Traffic(rate_per_s=12.0, mean_input_tokens=6000, mean_output_tokens=20)
DECODE_HEAVY = Traffic(rate_per_s=12.0, mean_input_tokens=200, mean_output_tokens=1500)


def test_prefill_prediction_follows_the_queue() -> None:
    t = PROFILE.prefill_s(6000)
    assert raw_ttft_s(PROFILE, Traffic(0, 6000, 10), 1) == pytest.approx(t)
    light = Traffic(1.0, 6000, 10)
    assert raw_ttft_s(PROFILE, light, 1) == pytest.approx(t / (1 - t))
    assert raw_ttft_s(PROFILE, light, 2) < raw_ttft_s(PROFILE, light, 1)
    assert raw_ttft_s(PROFILE, Traffic(1 / t, 6000, 10), 1) == math.inf  # saturated
    assert raw_ttft_s(PROFILE, light, 0) == math.inf


def test_decode_prediction_follows_the_batch() -> None:
    assert raw_itl_s(PROFILE, Traffic(0, 100, 100), 1) == pytest.approx(PROFILE.decode_base_s)
    # 12 req/s x 1500 tokens over 2 workers: 9000 tokens/s each, a step of a / (1 - b x).
    expected = PROFILE.decode_base_s / (1 - PROFILE.decode_per_seq_s * 9000)
    assert raw_itl_s(PROFILE, DECODE_HEAVY, 2) == pytest.approx(expected)
    assert raw_itl_s(PROFILE, DECODE_HEAVY, 3) < expected
    assert raw_itl_s(PROFILE, Traffic(1000, 10, 1000), 1) == math.inf


def test_correction_calibrates_a_constant_offset_and_is_clamped() -> None:
    c = Corrections()
    observed = Traffic(4.0, 6000, 20, observed_ttft_s=2 * raw_ttft_s(PROFILE, Traffic(4.0, 6000, 20), 2))
    for _ in range(8):
        c.update(PROFILE, observed, 2, 2)
    assert c.ttft == pytest.approx(2.0, rel=0.01)
    assert c.itl == 1.0  # nothing observed
    wild = Traffic(4.0, 6000, 20, observed_ttft_s=1e6)
    for _ in range(8):
        c.update(PROFILE, wild, 2, 2)
    assert c.ttft <= 4.0


def test_sized_pools_grow_at_once_and_shrink_with_headroom() -> None:
    policy = Policy(PROFILE, SLO, Limits(cooldown_s=0))
    up = policy.decide(0, PoolSizes(1, 1), PREFILL_HEAVY)
    assert up.desired.prefill > 1
    assert up.predicted_ttft_s <= SLO.ttft_s
    assert up.desired.prefill - 1 == 0 or policy.ttft_s(PREFILL_HEAVY, up.desired.prefill - 1) > SLO.ttft_s
    # The same load again: nothing moves.
    assert policy.decide(1, up.desired, PREFILL_HEAVY).desired == up.desired
    # Load just under what one fewer worker handles, but without headroom: the size holds.
    n = up.desired.prefill
    edge = PREFILL_HEAVY
    while policy.ttft_s(edge, n - 1) > SLO.ttft_s:
        edge = Traffic(edge.rate_per_s * 0.97, edge.mean_input_tokens, edge.mean_output_tokens)
    if policy.ttft_s(edge, n - 1) > Limits().headroom * SLO.ttft_s:
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
    with pytest.raises(ConfigError, match="--profile"):
        WorkerProfile.preset("no-such-gpu")


def test_a_role_that_is_neither_prefill_nor_decode_is_an_error_not_the_decode_pool() -> None:
    with pytest.raises(ValueError, match="unknown worker role 'decdoe'"):
        PoolSizes(1, 2).of("decdoe")
    with pytest.raises(ValueError, match="unknown worker role"):
        PoolSizes(1, 2).with_role("router", 3)
    assert PoolSizes(1, 2).with_role("prefill", 3) == PoolSizes(3, 2)
