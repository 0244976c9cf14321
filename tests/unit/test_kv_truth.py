"""The router's view of each worker's cache, and what it does when that view is wrong: named event
errors and resyncs (event_errors.py, kv_event_follower.py), the prediction table (predicted_cache.py)
and the per-worker fallback between them (kv_source.py, worker_pool.py). In-process, with the real radix tree
and an injected clock; no etcd, no process."""

from __future__ import annotations

import asyncio
import logging

import pytest
from prometheus_client import CollectorRegistry

from gen.kvmesh.v1 import worker_pb2, worker_pb2_grpc
from services.kv_protocol.hashing import chained_block_hashes, local_block_hashes
from services.mesh.channels import ChannelPool
from services.mesh.discovery import DECODE_WORKER, InstanceInfo
from services.routing import event_errors, kv_source, worker_pool
from services.routing.event_errors import EventErrorLedger, ResyncReason
from services.routing.kv_event_follower import EventStream
from services.routing.kv_index import EventErrorKind
from services.routing.kv_source import EVENTS, PREDICTED, KvSourceTracker
from services.routing.kv_truth import KvTruthConfig
from services.routing.predicted_cache import PredictedCache
from services.routing.router_metrics import KvTruthMetrics
from services.routing.worker_pool import WorkerPool
from services.config_error import ConfigError
from tests.unit.in_process_grpc import serving
from tests.unit.test_router_route import FakeView

BS = 4
PROMPT = list(range(100, 100 + 4 * BS))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stored(event_id: int, tokens: list[int], parent: int | None = None) -> worker_pb2.KvEvent:
    blocks = [worker_pb2.StoredBlock(block_hash=h, tokens_hash=t)
              for h, t in zip(chained_block_hashes(tokens, BS), local_block_hashes(tokens, BS), strict=True)]
    return worker_pb2.KvEvent(event_id=event_id, stored=worker_pb2.BlocksStored(parent_hash=parent, blocks=blocks))


def batch(*events: worker_pb2.KvEvent, snapshot: bool = False, instance_id: str = "w1",
          incarnation: int = 7) -> worker_pb2.KvEventBatch:
    return worker_pb2.KvEventBatch(events=events, snapshot=snapshot, instance_id=instance_id, incarnation=incarnation)


def one_worker_pool(clock: Clock) -> tuple[WorkerPool, EventStream, CollectorRegistry]:
    """A pool of one worker, w1, whose stream the test feeds (admit() follows nothing)."""
    registry = CollectorRegistry()
    pool = WorkerPool(FakeView(DECODE_WORKER), None, KvTruthConfig(), KvTruthMetrics(registry),  # type: ignore[arg-type]
                      clock=clock)
    assert pool.admit("w1", InstanceInfo(DECODE_WORKER, "w1", "w1.test:1", "m", block_size=BS))
    return pool, EventStream(pool.workers["w1"]), registry


@pytest.fixture
def pool() -> tuple[WorkerPool, EventStream, CollectorRegistry]:
    return one_worker_pool(Clock())


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


# -- named event errors at the pool --------------------------------------------------------------

def test_an_unknown_parent_is_counted_by_kind_and_resyncs_the_worker_from_a_snapshot(pool) -> None:  # noqa: ANN001
    p, stream, registry = pool
    assert p.events.take_batch(stream, batch(stored(1, PROMPT)))
    assert not p.events.take_batch(stream, batch(stored(2, PROMPT, parent=12345)))
    assert value(registry, "kvmesh_router_kv_event_errors_total", worker_id="w1", kind="unknown_parent") == 1
    assert value(registry, "kvmesh_router_kv_resyncs_total", worker_id="w1", reason="unknown_parent") == 1
    assert stream.want_snapshot and stream.last_event_id == 2
    # The snapshot replaces the view.
    assert p.events.take_batch(stream, batch(stored(2, PROMPT[:BS]), snapshot=True))
    assert not stream.want_snapshot
    assert p.index.find_matches(local_block_hashes(PROMPT, BS)) == {"w1": 1}


def test_removals_of_unknown_blocks_are_counted_but_never_resync(pool) -> None:  # noqa: ANN001
    p, stream, registry = pool
    for i in range(1, 10):
        removed = worker_pb2.KvEvent(event_id=i, removed=worker_pb2.BlocksRemoved(block_hashes=[i, i + 100]))
        assert p.events.take_batch(stream, batch(removed))
    assert value(registry, "kvmesh_router_kv_event_errors_total", worker_id="w1", kind="unknown_block") == 18
    assert not stream.want_snapshot


@pytest.mark.parametrize("kind", [EventErrorKind.CONTRADICTS_TREE, EventErrorKind.BAD_HASH])
def test_more_than_a_few_errors_in_a_window_resync_and_a_storm_resyncs_once_per_interval(kind: EventErrorKind) -> None:
    clock, counted = Clock(), []
    ledger = EventErrorLedger(lambda w, k, n: counted.append((w, k, n)), clock)
    reasons = [ledger.record("w", kind) for _ in range(event_errors.RESYNC_AFTER_ERRORS + 1)]
    assert reasons == [None] * event_errors.RESYNC_AFTER_ERRORS + ["errors"]  # the resync starts
    assert [ledger.record("w", kind) for _ in range(10)] == [None] * 10  # within the minimum interval
    clock.now += event_errors.RESYNC_MIN_INTERVAL_S
    assert ledger.record("w", kind) == "errors"
    assert len(counted) == event_errors.RESYNC_AFTER_ERRORS + 12


def test_errors_spread_wider_than_the_window_do_not_resync() -> None:
    clock = Clock()
    ledger = EventErrorLedger(clock=clock)
    for _ in range(10):
        assert ledger.record("w", EventErrorKind.BAD_HASH) is None
        clock.now += event_errors.RESYNC_WINDOW_S / 2


def test_the_warning_names_kinds_and_counts_at_most_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    ledger = EventErrorLedger(clock=clock)
    with caplog.at_level("WARNING", logger=event_errors.__name__):
        ledger.record("w", EventErrorKind.UNKNOWN_BLOCK, 3)
        ledger.record("w", EventErrorKind.BAD_HASH)
        clock.now += event_errors.WARN_INTERVAL_S
        ledger.record("w", EventErrorKind.UNKNOWN_BLOCK)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0].endswith("unknown_block x3") and lines[1].endswith("bad_hash x1, unknown_block x1")


def test_a_gap_in_event_ids_resyncs(pool) -> None:  # noqa: ANN001
    p, stream, registry = pool
    assert p.events.take_batch(stream, batch(stored(1, PROMPT)))
    assert not p.events.take_batch(stream, batch(stored(5, PROMPT[:BS])))
    assert value(registry, "kvmesh_router_kv_resyncs_total", worker_id="w1", reason="gap") == 1


def test_a_restarted_worker_is_rebuilt_and_an_address_that_serves_another_worker_drops_the_blocks(pool) -> None:  # noqa: ANN001
    p, stream, registry = pool
    assert p.events.take_batch(stream, batch(stored(1, PROMPT)))
    # Another incarnation answered without a snapshot: resync.
    assert not p.events.take_batch(stream, batch(stored(1, PROMPT), incarnation=8))
    assert value(registry, "kvmesh_router_kv_resyncs_total", worker_id="w1", reason="restart") == 1
    # Another worker at the address: this one's blocks go at once.
    assert not p.events.take_batch(stream, batch(instance_id="w2"))
    assert stream.worker.replaced and p.index.block_count("w1") == 0


def called_for(ledger: EventErrorLedger, reason: ResyncReason) -> str | None:
    """What the follower does: calls for a resync, and starts it if it is due."""
    ledger.call_for("w", reason)
    return ledger.due("w")


def test_every_resync_waits_for_its_interval_which_doubles_while_they_keep_coming_and_a_snapshot_satisfies_it() -> None:
    clock = Clock()
    ledger = EventErrorLedger(clock=clock)
    assert called_for(ledger, ResyncReason.GAP) == "gap"  # the first at once
    waits = []
    for _ in range(6):  # called for at every batch (one a half second) until it is due
        start = clock.now
        while called_for(ledger, ResyncReason.GAP) is None:
            clock.now += 0.5
        waits.append(clock.now - start)
    assert waits == [10, 20, 40, 80, 160, 160]
    assert event_errors.RESYNC_MIN_INTERVAL_S == 10 and event_errors.RESYNC_MAX_INTERVAL_S == 160
    # Quiet for twice its interval: the minimum again. The first reason called for is the one told.
    clock.now += 2 * event_errors.RESYNC_MAX_INTERVAL_S
    assert called_for(ledger, ResyncReason.RESTART) == "restart"
    assert called_for(ledger, ResyncReason.INACCURATE) is None
    assert called_for(ledger, ResyncReason.GAP) is None
    clock.now += event_errors.RESYNC_MIN_INTERVAL_S
    assert ledger.due("w") == "inaccurate" and ledger.due("w") is None
    # A snapshot that arrives anyway satisfies the resync called for.
    assert called_for(ledger, ResyncReason.GAP) is None
    ledger.rebuilt("w")
    clock.now += event_errors.RESYNC_MAX_INTERVAL_S
    assert ledger.due("w") is None


def test_a_worker_whose_ids_keep_skipping_costs_one_snapshot_per_interval_not_one_per_batch() -> None:
    clock = Clock()
    p, stream, registry = one_worker_pool(clock)
    assert p.events.take_batch(stream, batch(stored(1, PROMPT)))
    snapshots = []
    for second in range(30):  # a batch a second, each one skipping an id
        event_id = 3 + 2 * second
        if not p.events.take_batch(stream, batch(stored(event_id, PROMPT))):
            snapshots.append(second)
            assert stream.want_snapshot
            assert p.events.take_batch(stream, batch(stored(event_id, PROMPT), snapshot=True))  # what it asked for
        clock.now += 1
    assert snapshots == [0, 10]  # then 20 s until the next, 40 after that
    assert value(registry, "kvmesh_router_kv_resyncs_total", worker_id="w1", reason="gap") == 2
    assert p.index.find_matches(local_block_hashes(PROMPT, BS)) == {"w1": 4}  # applied meanwhile


def test_an_inaccurate_index_resyncs_at_its_streams_next_batch_within_the_same_limit() -> None:
    clock = Clock()
    p, stream, registry = one_worker_pool(clock)
    assert p.events.take_batch(stream, batch(stored(1, PROMPT)))
    p.events.resync("w1", ResyncReason.INACCURATE)  # what the source monitor does
    assert not p.events.take_batch(stream, batch())  # a heartbeat: the subscription ends, asking for a snapshot
    assert stream.want_snapshot
    assert p.events.take_batch(stream, batch(stored(1, PROMPT), snapshot=True))
    p.events.resync("w1", ResyncReason.INACCURATE)
    assert p.events.take_batch(stream, batch())  # too soon after the last: it waits
    clock.now += event_errors.RESYNC_MIN_INTERVAL_S
    assert not p.events.take_batch(stream, batch())
    assert value(registry, "kvmesh_router_kv_resyncs_total", worker_id="w1", reason="inaccurate") == 2


class ReplacingWorker(worker_pb2_grpc.WorkerServicer):
    """Whatever the pool asks, the address answers as worker w2 (w1 was killed, w2 took its port)."""

    def __init__(self) -> None:
        self.subscriptions = 0

    async def SubscribeKvEvents(self, request, context):  # noqa: ANN001, ANN201, N802
        self.subscriptions += 1
        yield worker_pb2.KvEventBatch(instance_id="w2", incarnation=9)
        await asyncio.Event().wait()  # open until the server stops (its load: unimplemented, retried)


async def test_a_replaced_worker_is_followed_no_more_and_its_silence_is_no_lost_stream() -> None:
    clock, registry, channels, worker = Clock(), CollectorRegistry(), ChannelPool(), ReplacingWorker()
    async with serving(worker_pb2_grpc.add_WorkerServicer_to_server, worker) as address:
        p = WorkerPool(FakeView(DECODE_WORKER), channels, KvTruthConfig(), KvTruthMetrics(registry), clock=clock)
        assert isinstance(p.view, FakeView)
        p.view.announce("w1", InstanceInfo(DECODE_WORKER, "w1", address, "m", block_size=BS))
        try:
            await asyncio.wait_for(asyncio.shield(p.events._tasks["w1"]), 5)  # its follower ended by itself
            assert worker.subscriptions == 1 and p.workers["w1"].replaced and p.candidates("m") == []
            assert await p.wait_synced(0) == []
            clock.now += kv_source.STREAM_GRACE_S + 1
            assert p._sources.evaluate("w1", None) is None and "w1" not in p._sources.workers()
            assert registry.get_sample_value("kvmesh_router_kv_source", {"worker_id": "w1"}) is None
        finally:
            await p.stop()
            await channels.close()


async def test_a_failing_sweep_of_the_source_monitor_is_logged_and_the_next_one_runs(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(worker_pool, "EVALUATE_EVERY_S", 0.001)
    channels = ChannelPool()
    p = WorkerPool(FakeView(DECODE_WORKER), channels)
    assert isinstance(p.view, FakeView)
    p.view.announce("quiet", InstanceInfo(DECODE_WORKER, "quiet", "127.0.0.1:1", "m", block_size=BS, kv_events=False))
    swept, calls = asyncio.Event(), []

    def evaluate(worker: str, accuracy: float | None) -> None:
        calls.append(worker)
        if len(calls) == 1:
            raise RuntimeError("a bug in one sweep")
        swept.set()

    monkeypatch.setattr(p._sources, "evaluate", evaluate)
    try:
        with caplog.at_level(logging.ERROR, logger=worker_pool.__name__):
            await asyncio.wait_for(swept.wait(), 5)
        assert any("evaluating the KV sources" in r.getMessage() for r in caplog.records)
    finally:
        await p.stop()
        await channels.close()


# -- the prediction table ------------------------------------------------------------------------

def test_a_routed_prompt_is_predicted_for_the_ttl_and_renewed_by_routing_it_again() -> None:
    clock = Clock()
    cache = PredictedCache(ttl_s=10, max_blocks=100, clock=clock)
    hashes = local_block_hashes(PROMPT, BS)
    cache.routed("w", hashes)
    assert cache.score("w", hashes) == 4 and cache.score("other", hashes) == 0
    assert cache.score("w", local_block_hashes(PROMPT[:BS] + [1] * BS, BS)) == 1  # a shared first block
    clock.now += 9
    cache.routed("w", hashes[:2])
    clock.now += 2  # the last two blocks expired, the first two were renewed
    assert cache.score("w", hashes) == 2
    assert cache.block_count("w") == 2
    clock.now += 10
    assert cache.scores(["w"], hashes) == {}


def test_a_worker_prediction_holds_at_most_max_blocks_the_least_recently_routed_going_first() -> None:
    cache = PredictedCache(ttl_s=100, max_blocks=6, clock=Clock())
    a, b = local_block_hashes(PROMPT, BS), local_block_hashes([7] * 4 * BS, BS)
    cache.routed("w", a)
    cache.routed("w", b)
    assert cache.block_count("w") == 6
    assert cache.score("w", b) == 4
    assert cache.score("w", a) == 0  # its first two blocks went first: nothing reusable from the start


def test_a_block_is_keyed_by_its_prefix_not_its_tokens_alone() -> None:
    cache = PredictedCache(ttl_s=100, max_blocks=100, clock=Clock())
    cache.routed("w", local_block_hashes([1] * BS + [2] * BS, BS))
    assert cache.score("w", local_block_hashes([2] * BS, BS)) == 0


# -- the fallback state machine ------------------------------------------------------------------

class Switches(list[tuple[str, str, str]]):
    def __call__(self, worker: str, source: str, reason: str) -> None:
        self.append((worker, source, reason))


def tracker(clock: Clock, router_off: bool = False) -> tuple[KvSourceTracker, Switches]:
    switches = Switches()
    return KvSourceTracker(switches, 0.5, router_off, clock), switches


def test_a_silent_stream_switches_to_prediction_after_the_grace_and_back_when_it_delivers() -> None:
    clock = Clock()
    t, switches = tracker(clock)
    t.add("w", publishes=True)
    clock.now += kv_source.STREAM_GRACE_S
    assert t.evaluate("w", None) is None and t.source("w") == EVENTS
    clock.now += 0.1
    assert t.evaluate("w", None) == "stream_lost" and t.source("w") == PREDICTED
    assert t.evaluate("w", None) is None  # said once
    t.heard("w")
    assert t.evaluate("w", None) == "stream_back" and t.source("w") == EVENTS
    assert switches == [("w", PREDICTED, "stream_lost"), ("w", EVENTS, "stream_back")]


def test_a_worker_without_events_and_a_router_without_events_predict() -> None:
    clock = Clock()
    t, switches = tracker(clock)
    t.add("quiet", publishes=False)
    assert t.source("quiet") == PREDICTED and switches == [("quiet", PREDICTED, "worker_off")]
    off, _ = tracker(clock, router_off=True)
    off.add("w", publishes=True)
    assert off.source("w") == PREDICTED and off.source("unknown") == PREDICTED


def test_an_inaccurate_index_predicts_until_its_engine_agrees_with_it_again() -> None:
    clock = Clock()
    t, switches = tracker(clock)
    t.add("w", publishes=True)
    assert t.evaluate("w", 0.9) is None
    assert t.evaluate("w", 0.2) == "inaccurate" and t.wants_agreement("w")
    for _ in range(kv_source.AGREEMENT_SAMPLES):
        t.agreement("w", 0.0)  # the engine found none of what the index said
    assert t.evaluate("w", None) is None and t.source("w") == PREDICTED
    for _ in range(kv_source.AGREEMENT_SAMPLES):
        t.agreement("w", 1.0)
    assert t.evaluate("w", None) == "agreeing" and t.source("w") == EVENTS
    t.agreement("w", 0.0)  # on its events: agreement is no longer asked
    assert not t.wants_agreement("w")
    assert t.evaluate("w", 0.2) == "inaccurate"  # fresh samples (the pool forgot the old at the switch)
    assert [s[2] for s in switches] == ["inaccurate", "agreeing", "inaccurate"]


def test_an_inaccurate_worker_tries_its_events_again_after_the_retry_interval_whatever_its_samples() -> None:
    clock = Clock()
    t, _ = tracker(clock)
    t.add("w", publishes=True)
    t.evaluate("w", 0.0)
    for _ in range(kv_source.AGREEMENT_SAMPLES):
        t.agreement("w", 0.0)
    clock.now += kv_source.RETRY_EVENTS_S
    t.heard("w")
    assert t.evaluate("w", None) == "retry" and t.source("w") == EVENTS


def test_a_quiet_workers_index_counts_beside_its_prediction_for_the_ttl_only() -> None:
    clock = Clock()
    t, _ = tracker(clock)
    t.add("w", publishes=True)
    clock.now += kv_source.STREAM_GRACE_S + 0.1
    assert t.evaluate("w", None) == "stream_lost"
    assert t.index_still_warm("w", ttl_s=10)
    clock.now += 10
    assert not t.index_still_warm("w", ttl_s=10)
    t.add("x", publishes=True)
    t.evaluate("x", 0.0)  # inaccurate: its index is not trusted at all
    assert not t.index_still_warm("x", ttl_s=10)


async def test_the_pool_scores_a_predicted_worker_from_the_prompts_routed_to_it() -> None:
    registry = CollectorRegistry()
    p = WorkerPool(FakeView(DECODE_WORKER), None, KvTruthConfig(), KvTruthMetrics(registry))  # type: ignore[arg-type]
    view = p.view
    assert isinstance(view, FakeView)
    view.announce("quiet", InstanceInfo(DECODE_WORKER, "quiet", "q.test:1", "m", block_size=BS, kv_events=False))
    try:
        hashes = local_block_hashes(PROMPT, BS)
        assert p.kv_source("quiet") == PREDICTED and p.workers["quiet"].synced
        assert value(registry, "kvmesh_router_kv_source", worker_id="quiet") == 1
        assert p.matches_by_tier(hashes) == ({}, {})
        p.routed("quiet", hashes)
        assert p.matches_by_tier(hashes) == ({"quiet": 4}, {})
    finally:
        await p.stop()


def test_the_config_refuses_what_cannot_work() -> None:
    with pytest.raises(ConfigError):
        KvTruthConfig(kv_events="maybe")
    with pytest.raises(ConfigError):
        KvTruthConfig(prediction_ttl_s=0)
    with pytest.raises(ConfigError):
        KvTruthConfig(index_accuracy_floor=1.5)
