"""What the planner reads from the mesh's metrics, in-process: where prompts were prefilled (the
decode workers' counters), arrivals counted with the requests still in flight, and restarts."""

from __future__ import annotations

import pytest

from services.planner.traffic import Counters, PrefillCounters, parse_prefill_counters, traffic_of

WORKER_METRICS = """# TYPE kvmesh_decode_remote_prefill counter
kvmesh_decode_remote_prefill_total 30
# TYPE kvmesh_decode_local_prefill counter
kvmesh_decode_local_prefill_total 10
# TYPE kvmesh_decode_remote_prefill_tokens counter
kvmesh_decode_remote_prefill_tokens_total 60000
# TYPE kvmesh_decode_local_prefill_tokens counter
kvmesh_decode_local_prefill_tokens_total 640
"""


def test_the_decode_workers_say_where_prompts_were_prefilled() -> None:
    later = parse_prefill_counters(WORKER_METRICS)
    assert later == PrefillCounters(remote=30, local=10, remote_tokens=60000, local_tokens=640)
    delta = later.minus(PrefillCounters(remote=10, local=2, remote_tokens=20000, local_tokens=128))
    t = traffic_of(Counters(requests=28, prompt_tokens=40512, completion_tokens=280), 2.0, delta)
    assert t.remote_share == pytest.approx(20 / 28)
    assert t.remote_prompt_tokens == pytest.approx(2000)
    assert t.local_prompt_tokens == pytest.approx(64)
    # Nothing read from the workers: unknown, not "all local".
    assert traffic_of(Counters(requests=28), 2.0).remote_share is None


def test_arrivals_count_the_requests_still_in_flight() -> None:
    """A saturated pool answers fewer requests than arrive: the growth of those in flight is load."""
    earlier, later = Counters(requests=100, inflight=5), Counters(requests=110, inflight=45)
    t = traffic_of(later.minus(earlier), 2.0)
    assert t.rate_per_s == pytest.approx((10 + 40) / 2)
    # In flight falling is the backlog being answered, not a restart.
    drained = Counters(requests=160, inflight=5).minus(later)
    assert drained.requests == 50 and drained.inflight == -40
    assert traffic_of(drained, 2.0).rate_per_s == pytest.approx(5.0)


def test_a_restarted_instance_counts_from_zero() -> None:
    before = PrefillCounters(remote=50, local=5, remote_tokens=1000, local_tokens=50)
    after = PrefillCounters(remote=3, local=1, remote_tokens=60, local_tokens=10)
    assert after.minus(before) == after
