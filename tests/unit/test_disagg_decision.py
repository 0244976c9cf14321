"""The conditional disaggregation rule: remote iff the uncached prompt is longer than the limit and the prefill queue is short."""

from __future__ import annotations

from services.decode_worker.disagg_decision import DisaggConfig, absolute_prefill_length, prefill_remote

RULE = DisaggConfig(max_local_prefill_length=512, max_prefill_queue_size=2)


def test_a_long_uncached_prompt_with_a_short_queue_goes_remote() -> None:
    assert prefill_remote(2000, 0.0, queue_size=0, config=RULE)
    assert prefill_remote(513, 0.0, queue_size=1, config=RULE)


def test_only_the_uncached_part_counts() -> None:
    assert absolute_prefill_length(2000, 0.75) == 500
    assert not prefill_remote(2000, 0.75, queue_size=0, config=RULE)
    assert prefill_remote(2000, 0.7, queue_size=0, config=RULE)


def test_at_or_below_the_threshold_stays_local() -> None:
    assert not prefill_remote(512, 0.0, queue_size=0, config=RULE)
    assert not prefill_remote(10, 0.0, queue_size=0, config=RULE)


def test_a_full_prefill_queue_keeps_the_prefill_local() -> None:
    assert not prefill_remote(4000, 0.0, queue_size=2, config=RULE)
    assert not prefill_remote(4000, 0.0, queue_size=9, config=RULE)


def test_remote_prefill_off_means_always_local() -> None:
    off = DisaggConfig(remote_prefill=False)
    assert not prefill_remote(100_000, 0.0, queue_size=0, config=off)


def test_conditional_disagg_off_means_always_remote() -> None:
    always = DisaggConfig(conditional_disagg=False, max_prefill_queue_size=2)
    assert prefill_remote(1, 0.99, queue_size=50, config=always)
