"""The planner's encode pool (E/P/D), in-process: Erlang's wait, the sizing with hysteresis and
cool-down inside the policy, what the metrics readings make of the workers' counters, and an
encode worker's busy time."""

from __future__ import annotations

import math

import pytest

from services.config_error import ConfigError
from services.planner.encode_pool import (
    WAIT_SHARE_OF_TTFT,
    EncodeLimits,
    EncodeTraffic,
    encode_pool_size,
    erlang_c_wait,
)
from services.planner.model import Traffic
from services.planner.policy import Limits, Policy
from services.planner.pools import PoolSizes
from services.planner.traffic import EncoderCounters, encode_traffic_of, parse_encoder, parse_prefill_counters
from services.worker.encode_servicer import EncoderBusy
from tests.unit.test_planner_policy import PROFILE, SLO

LIMITS = EncodeLimits(0, 6)
BUDGET_S = WAIT_SHARE_OF_TTFT * SLO.ttft_s


def test_erlang_c_is_the_textbook_wait_and_unbounded_past_the_pool() -> None:
    # a = 2 erlangs on 3 servers: C = (8/6 * 3) / (1 + 2 + 2 + 4) = 4/9; Wq = C * s / (n - a).
    assert erlang_c_wait(2.0, 1.0, 3) == pytest.approx(4 / 9)
    assert erlang_c_wait(1.0, 0.5, 1) == pytest.approx(0.5 * 0.5 / 0.5)  # M/M/1: rho s / (1 - rho)
    assert erlang_c_wait(2.0, 1.0, 2) == math.inf
    assert erlang_c_wait(0.0, 1.0, 0) == 0.0
    assert erlang_c_wait(30.0, 0.1, 4) > erlang_c_wait(30.0, 0.1, 5) > erlang_c_wait(30.0, 0.1, 6)


def test_the_pool_gets_the_fewest_workers_whose_wait_fits_and_shrinks_only_with_headroom() -> None:
    busy = EncodeTraffic(rate_per_s=30.0, service_s=0.1)  # 3 erlangs
    n, why = encode_pool_size(1, busy, LIMITS, BUDGET_S, 0.7)
    assert erlang_c_wait(30.0, 0.1, n) <= BUDGET_S < erlang_c_wait(30.0, 0.1, n - 1) and "wait" in why
    # Between the size that fits and the one that fits with headroom, the pool keeps its size.
    relaxed = next(k for k in range(1, 7) if erlang_c_wait(30.0, 0.1, k) <= 0.7 * BUDGET_S)
    assert encode_pool_size(relaxed + 2, busy, LIMITS, BUDGET_S, 0.7)[0] == relaxed
    assert encode_pool_size(n, busy, LIMITS, BUDGET_S, 0.7)[0] == n
    # More than the most it may have: the most.
    assert encode_pool_size(1, EncodeTraffic(300.0, 0.1), LIMITS, BUDGET_S, 0.7)[0] == 6


def test_images_with_no_measured_cost_start_one_worker_and_an_idle_pool_goes_to_its_floor() -> None:
    assert encode_pool_size(0, EncodeTraffic(0.5, None), LIMITS, BUDGET_S, 0.7)[0] == 1
    assert encode_pool_size(3, EncodeTraffic(0.5, None), LIMITS, BUDGET_S, 0.7)[0] == 3
    assert encode_pool_size(3, EncodeTraffic(), LIMITS, BUDGET_S, 0.7) == (0, "no images to encode")
    assert encode_pool_size(3, EncodeTraffic(), EncodeLimits(2, 6), BUDGET_S, 0.7)[0] == 2


def test_the_policy_sizes_the_encode_pool_beside_the_others_and_cools_it_down() -> None:
    policy = Policy(PROFILE, SLO, Limits(encode=LIMITS, cooldown_s=30.0))
    quiet = Traffic(0.1, 100, 10, encode=EncodeTraffic(30.0, 0.1))
    up = policy.decide(0.0, PoolSizes(1, 1, 1), quiet)
    assert up.desired.encode > 1 and "encode pool 1 ->" in up.reason
    idle = Traffic(0.1, 100, 10)
    assert policy.decide(10.0, up.desired, idle).desired.encode == up.desired.encode  # cooling down
    assert policy.decide(100.0, up.desired, idle).desired.encode == 0
    # Not asked to size it: the pool stays as it is, whatever the images.
    assert Policy(PROFILE, SLO, Limits()).decide(0.0, PoolSizes(1, 1, 2), quiet).desired.encode == 2


def test_encode_limits_validate_themselves() -> None:
    assert not EncodeLimits().sized and EncodeLimits(0, 1).sized
    with pytest.raises(ConfigError, match="--min-encode-workers"):
        EncodeLimits(3, 2)
    with pytest.raises(ConfigError):
        EncodeLimits(-1, 2)


def test_the_readings_count_every_image_asked_and_the_encoders_cost_per_image() -> None:
    asking = """# TYPE kvmesh_remote_encodes counter
kvmesh_remote_encodes_total{outcome="remote"} 6.0
kvmesh_remote_encodes_total{outcome="remote_cached"} 2.0
kvmesh_remote_encodes_total{outcome="no_encode_worker"} 2.0
"""
    encoders = """# TYPE kvmesh_encoder_busy_seconds counter
kvmesh_encoder_busy_seconds_total{worker_id="e1"} 0.6
kvmesh_encoder_busy_seconds_total{worker_id="e2"} 0.2
# TYPE kvmesh_encoder_images counter
kvmesh_encoder_images_total{worker_id="e1"} 5.0
kvmesh_encoder_images_total{worker_id="e2"} 3.0
"""
    asked, encoded = parse_prefill_counters(asking).encode_asked, parse_encoder(encoders)
    assert asked == 10.0 and encoded == EncoderCounters(pytest.approx(0.8), 8.0)
    assert encode_traffic_of(asked, encoded, 5.0) == EncodeTraffic(2.0, pytest.approx(0.1))
    assert encode_traffic_of(asked, EncoderCounters(), 5.0).service_s is None


def test_an_encoders_busy_time_counts_overlapping_calls_once_and_the_call_under_way() -> None:
    now = [0.0]
    busy = EncoderBusy(clock=lambda: now[0])
    busy.begin()
    now[0] = 1.0
    busy.begin()  # a second image while the first is in hand
    now[0] = 2.0
    busy.end(encoded=True)
    assert busy.seconds() == pytest.approx(2.0)  # still busy: the open interval counts
    now[0] = 3.0
    busy.end(encoded=False)  # refused: not an image encoded
    now[0] = 10.0
    assert busy.seconds() == pytest.approx(3.0) and busy.images == 1
