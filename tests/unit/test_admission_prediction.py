"""The pieces of a predicted time to first token, and the edge's reading of a request's QoS."""

from __future__ import annotations

import pytest

from gen.kvmesh.v1 import worker_pb2
from services.frontend.errors import ApiError
from services.frontend.qos import OutsideQueue, request_qos
from services.mesh.recent_quantile import RecentQuantile
from services.routing.admission.prediction import (
    MIN_RATE_ENDS,
    RATE_WINDOW_S,
    HoldTime,
    LineRate,
    ServiceRate,
    prefill_s,
    queue_wait_s,
)


def test_queue_wait_is_the_requests_ahead_at_the_pools_pace() -> None:
    assert queue_wait_s(0, 32, 1.0) == 0.0
    assert queue_wait_s(32, 32, 0.5) == pytest.approx(0.5)
    assert queue_wait_s(10, 0, 1.0) == 0.0  # a pool that says nothing of its slots


def test_hold_time_is_a_moving_average_with_a_fallback_until_measured() -> None:
    hold = HoldTime()
    assert hold.or_else(1.5) == 1.5
    hold.observe(2.0)
    hold.observe(0.0)
    assert hold.or_else(1.5) == pytest.approx(1.9)


def test_the_service_rate_needs_enough_recent_ends() -> None:
    rate = ServiceRate()
    for i in range(MIN_RATE_ENDS - 1):
        rate.ended_while_full(i * 0.1)
    assert rate.per_s(1.0) is None
    rate.ended_while_full((MIN_RATE_ENDS - 1) * 0.1)
    assert rate.per_s(1.0) == pytest.approx(10.0)
    assert rate.per_s(100.0) is None  # all of them out of the window


def test_a_lines_pace_counts_only_the_gaps_it_spent_waiting() -> None:
    line = LineRate()
    t = 0.0
    for _ in range(MIN_RATE_ENDS + 1):  # backlogged: one departure every 0.2 s
        line.departed(t, 1)
        t += 0.2
    line.departed(t, 0)  # emptied
    line.departed(t + 3.0, 1)  # 3 s later it departs again: that gap is not its pace
    assert line.per_s(t + 3.0) == pytest.approx(5.0)
    assert line.per_s(t + 3.0 + RATE_WINDOW_S + 1) is None


def test_prefill_is_the_workers_own_price_of_the_uncached_tokens() -> None:
    load = worker_pb2.LoadMetrics(prefill_cost=worker_pb2.PrefillCost(us_per_token=100, us_per_token_per_1k=1000))
    # 1000 tokens after 1000 cached: mean position 1500 -> 100 + 1500 us per token.
    assert prefill_s(load, 1000, 1000) == pytest.approx(1000 * 1600 / 1e6)
    assert prefill_s(load, 0, 1000) == 0.0
    assert prefill_s(worker_pb2.LoadMetrics(), 1000, 0) == 0.0  # a worker that says nothing


def test_recent_quantile_takes_the_value_again_every_few_samples() -> None:
    q = RecentQuantile(0.9, samples=10, every=5)
    for x in range(1, 5):
        q.observe(x)
    assert q.value == 4  # the first ones set it at once
    for x in range(100, 106):
        q.observe(x)
    assert q.value == 105
    with pytest.raises(ValueError):
        RecentQuantile(1.5)


def test_outside_queue_is_ttft_less_the_queue_wait() -> None:
    outside = OutsideQueue()
    outside.observe(0.25, 200)
    assert outside.p90_ms == 50
    outside.observe(0.1, 300)  # the clocks disagree a little: never negative
    assert outside.p90_ms == 50


@pytest.mark.parametrize(("headers", "body", "tenant_header", "expected"), [
    ({}, None, None, (0, "key", 0)),
    ({"x-kvmesh-priority": "-3", "x-kvmesh-ttft-objective-ms": "800"}, None, None, (-3, "key", 800)),
    ({"x-kvmesh-priority": "5"}, 2, None, (2, "key", 0)),  # the body's field wins
    ({"x-tenant": " team-b "}, None, "x-tenant", (0, "team-b", 0)),
    ({}, None, "x-tenant", (0, "key", 0)),  # no header: the key's tenant
])
def test_request_qos(headers: dict[str, str], body: int | None, tenant_header: str | None,
                     expected: tuple[int, str, int]) -> None:
    qos = request_qos(headers, body, "key", tenant_header, 40)
    assert (qos.priority, qos.tenant, qos.ttft_objective_ms) == expected and qos.outside_queue_ms == 40


@pytest.mark.parametrize(("headers", "param"), [
    ({"x-kvmesh-priority": "soon"}, "x-kvmesh-priority"),
    ({"x-kvmesh-priority": str(2**31)}, "x-kvmesh-priority"),
    ({"x-kvmesh-ttft-objective-ms": "0"}, "x-kvmesh-ttft-objective-ms"),
    ({"x-kvmesh-ttft-objective-ms": "1e3"}, "x-kvmesh-ttft-objective-ms"),
    ({"x-tenant": "x" * 65}, "x-tenant"),
    ({"x-tenant": "caf\u00e9"}, "x-tenant"),
])
def test_a_bad_qos_header_is_a_400_naming_it(headers: dict[str, str], param: str) -> None:
    with pytest.raises(ApiError) as exc:
        request_qos(headers, None, "", "x-tenant")
    assert exc.value.status == 400 and exc.value.param == param
