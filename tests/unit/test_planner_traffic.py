"""What the planner reads from the mesh's metrics, in-process: where prompts were prefilled (the
decode workers' counters), the requests that arrived, and restarts."""

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


def test_the_load_is_what_arrived_not_what_was_answered() -> None:
    """A saturated pool answers fewer requests than arrive: the planner sizes for the arrivals."""
    earlier, later = Counters(requests=100, arrived=105), Counters(requests=110, arrived=165)
    assert traffic_of(later.minus(earlier), 2.0).rate_per_s == pytest.approx(60 / 2)
    # A frontend without the arrivals counter is read by its answers.
    assert traffic_of(Counters(requests=10), 2.0).rate_per_s == pytest.approx(5.0)


def test_a_restarted_instance_counts_from_zero() -> None:
    before = PrefillCounters(remote=50, local=5, remote_tokens=1000, local_tokens=50)
    after = PrefillCounters(remote=3, local=1, remote_tokens=60, local_tokens=10)
    assert after.minus(before) == after
