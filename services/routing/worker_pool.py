"""The router's view of the workers of one role: who they are, their cached blocks, their load.

Workers come from etcd. For each one the pool follows its load metrics (with its LoRA adapters'
states: worker_adapters.py, which also says which adapters a worker knows), and its KV events into
the pool's radix tree (kv_event_follower.py: resuming, resyncing from a snapshot, dropping a
worker whose address another worker answers at now); when its lease goes, both end and all the
worker's blocks are dropped.

Where the events are off or cannot be trusted, the pool predicts the worker's cache from the
prompts routed to it instead (kv_source.py says when, predicted_cache.py how); `matches_by_tier`
merges the two, `routed` feeds the prediction. The pool owns the index's accuracy per worker
(index_accuracy.py: the router records it, the source monitor acts on it), as it owns the index.

Built once with its settings (kv_truth.py) and metrics: with `--kv-events off` it never
subscribes to any worker's events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

from gen.kvmesh.v1 import worker_pb2, worker_pb2_grpc
from services.mesh.discovery import ComponentView, InstanceInfo
from services.mesh.channels import ChannelPool
from services.mesh.tasks import cancel_and_wait
from services.kv_protocol.hashing import LocalBlockHash
from services.routing.event_errors import ResyncReason
from services.routing.index_accuracy import IndexAccuracy
from services.routing.kv_event_follower import RESUBSCRIBE_BACKOFF_S, KvEventFollower
from services.routing.kv_index import KvIndex
from services.routing.kv_truth import KvTruthConfig
from services.routing.kv_source import EVALUATE_EVERY_S, PREDICTED, KvSource, KvSourceTracker, SwitchReason
from services.routing.predicted_cache import PredictedCache
from services.routing.index_choice import new_index
from services.routing.router_metrics import KvTruthMetrics
from services.routing.worker_adapters import AdapterView, WorkerAdapters
from services.routing.worker_images import WorkerImages

log = logging.getLogger(__name__)

# A dispatched request is counted as pending until a metrics report at least this much newer
# arrives: long enough for the request to have reached the worker's queue.
PENDING_GRACE_S = 0.05
MAX_PENDING = 4096
# How long a router (or a processor routing locally) waits for every worker's cached blocks
# before serving.
SYNC_TIMEOUT_S = 10.0
# An accuracy over fewer samples than this is not acted on.
MIN_ACCURACY_SAMPLES = 8

Matches = dict[Hashable, int]


@dataclass(slots=True)
class WorkerState:
    info: InstanceInfo
    load: worker_pb2.LoadMetrics = field(default_factory=worker_pb2.LoadMetrics)
    # The worker's address answers as another worker: this one is gone, its blocks dropped, its
    # events followed no more (kv_event_follower.py).
    replaced: bool = False
    # The index holds everything the worker had cached when this router subscribed to it.
    synced: bool = False
    # (dispatch time, new blocks) of requests this router sent that the worker has not reported yet.
    pending: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=MAX_PENDING))
    # The sum of `pending`'s blocks, kept with it: routing reads it per request, and between two
    # load reports `pending` holds every request dispatched (thousands at a high rate).
    pending_blocks: int = 0
    # Its LoRA adapters: its latest report's states, and those this router sent it requests of.
    adapters: WorkerAdapters = field(default_factory=WorkerAdapters)
    # Its series of the router's load metrics, once the pool follows it (WorkerPool._follow).
    load_reports: Counter | None = None
    pending_gauge: Gauge | None = None
    # Its encoder cache as this router sees it (worker_images.py).
    images: WorkerImages = field(default_factory=WorkerImages)

    def add_pending(self, new_blocks: int, lora_name: str = "") -> None:
        now = time.monotonic()
        pending = self.pending
        if len(pending) == pending.maxlen:
            self.pending_blocks -= pending[0][1]  # the append drops the oldest
        pending.append((now, new_blocks))
        self.pending_blocks += new_blocks
        self.adapters.dispatched(lora_name, now)

    def observe_load(self, load: worker_pb2.LoadMetrics) -> None:
        self.load = load
        self.images.observe(load)
        now = time.monotonic()
        self.adapters.observe(load, now)
        horizon = now - PENDING_GRACE_S
        pending = self.pending
        while pending and pending[0][0] < horizon:
            self.pending_blocks -= pending.popleft()[1]

    def knows_adapter(self, lora_name: str) -> bool:
        """Whether the worker serves LoRA adapter `lora_name` (always, the base model ""): its
        etcd record or its latest load report lists it."""
        return self.adapters.knows(lora_name, self.info.lora_adapters)

    def adapter(self, lora_name: str) -> AdapterView:
        """Adapter `lora_name` on this worker as routing weighs it (worker_adapters.py)."""
        return self.adapters.view(lora_name)

    def pending_counts(self) -> tuple[int, int]:
        return len(self.pending), self.pending_blocks


class WorkerPool:
    def __init__(self, view: ComponentView, channels: ChannelPool, truth: KvTruthConfig | None = None,
                 metrics: KvTruthMetrics | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """`truth`: where each worker's cache is learned (the defaults: its events); `metrics`: the
        process's (one per registry, shared by its pools; by default, metrics nobody scrapes);
        `clock`: the fallback's and the resync limit's (tests drive it)."""
        truth = truth or KvTruthConfig()
        self.view = view
        self.index: KvIndex = new_index()
        self._channels = channels
        self.workers: dict[str, WorkerState] = {}
        self._block_size_by_model: dict[str, int] = {}
        self._load_tasks: dict[str, asyncio.Task[None]] = {}
        self._ending: set[asyncio.Task[None]] = set()  # load tasks of workers that left, until they end
        self._synced_changed = asyncio.Event()
        # Called with the worker's id after every load report and membership change (admission:
        # room may have freed).
        self._load_listeners: list[Callable[[str], None]] = []
        self._metrics = metrics if metrics is not None else KvTruthMetrics(CollectorRegistry())
        # How right the index was about each worker lately, from the engines' reports (the router records them).
        self.accuracy = IndexAccuracy()
        self.predicted = PredictedCache(truth.prediction_ttl_s, truth.prediction_max_blocks, clock)
        self._sources = KvSourceTracker(self._source_switched, truth.index_accuracy_floor, truth.kv_events == "off",
                                        clock)
        self.events = KvEventFollower(self.index, channels, self._metrics, self._sources, self._synced_changed.set,
                                      clock)
        self._monitor: asyncio.Task[None] | None = None
        if self._sources.router_off:
            log.info("KV events off: predicting every %s's cache from the prompts routed to it (TTL %.0fs, %d blocks "
                     "at most)", view.component, truth.prediction_ttl_s, truth.prediction_max_blocks)
        view.add_listener(self._on_change)

    def kv_source(self, instance_id: str) -> KvSource:
        """Where the router learns the worker's cache now (kv_source.py)."""
        return self._sources.source(instance_id)

    def matches_by_tier(self, local_hashes: Sequence[LocalBlockHash]) -> tuple[Matches, Matches]:
        """The index's `find_matches_by_tier`, with each predicted worker's score from the
        prediction instead (device tier only: the prediction knows nothing of host memory). A
        worker whose stream went quiet lately keeps what its index said, where that is more: those
        blocks were right when it went quiet (kv_source.py `index_still_warm`)."""
        if self._sources.router_off:
            return self.predicted.scores(self.workers, local_hashes), {}
        device, host = self.index.find_matches_by_tier(local_hashes)
        predicted = [w for w in self.workers if self._sources.predicted(w)]
        if predicted:
            scores = self.predicted.scores(predicted, local_hashes)
            ttl_s = self.predicted.ttl_s
            for w in predicted:
                indexed = device.pop(w, 0)
                host.pop(w, None)
                best = max(indexed if self._sources.index_still_warm(w, ttl_s) else 0, scores.get(w, 0))
                if best:
                    device[w] = best
        return device, host

    def index_score(self, instance_id: str, local_hashes: Sequence[LocalBlockHash]) -> int | None:
        """What the index alone says the worker caches of the prompt (its device and host tiers),
        where the worker is predicted for an index found wrong and that is to be judged again
        (kv_source.py); None otherwise."""
        if not self._sources.wants_agreement(instance_id):
            return None
        device, host = self.index.find_matches_by_tier(local_hashes)
        return device.get(instance_id, 0) + host.get(instance_id, 0)

    def agreement(self, instance_id: str, ratio: float) -> None:
        """The engine's judgement of one `index_score` (index_accuracy.py's ratio)."""
        self._sources.agreement(instance_id, ratio)

    def routed(self, instance_id: str, local_hashes: Sequence[LocalBlockHash]) -> None:
        """A prompt was sent to the worker (and counted pending there: the `pending` gauge says
        how many are until its next load report): where its cache is predicted, its blocks are
        now. Only there (or with every worker predicted): recording costs about as much as
        hashing the prompt, which a worker whose events are healthy does not need."""
        if (state := self.workers.get(instance_id)) is not None and state.pending_gauge is not None:
            state.pending_gauge.set(len(state.pending))
        if self._sources.predicted(instance_id):
            self.predicted.routed(instance_id, local_hashes)

    def _source_switched(self, instance_id: str, source: KvSource, reason: SwitchReason) -> None:
        self.accuracy.forget(instance_id)  # samples of one source never judge the other
        self._metrics.source.labels(instance_id).set(source == PREDICTED)
        self._metrics.source_switches.labels(instance_id, source, reason).inc()
        if reason is SwitchReason.ROUTER_OFF:
            return  # said once for the pool (at its construction)
        if source == PREDICTED:
            log.warning("worker %s: routing on a prediction of its cache from the prompts sent to it (%s)",
                        instance_id, reason)
        else:
            log.info("worker %s: routing on its KV events again (%s)", instance_id, reason)

    def _recent_accuracy(self, instance_id: str) -> float | None:
        if len(self.accuracy.samples(instance_id)) < MIN_ACCURACY_SAMPLES:
            return None
        return self.accuracy.recent(instance_id)

    async def _watch_sources(self) -> None:
        """Evaluates every worker's source on a clock (a silent stream gives no other cue). A bug
        in one sweep is logged and the next sweep runs: fallback detection never stops for good."""
        while True:
            await asyncio.sleep(EVALUATE_EVERY_S)
            try:
                for instance_id in self._sources.workers():
                    if self._sources.evaluate(instance_id, self._recent_accuracy(instance_id)) is SwitchReason.INACCURATE:
                        self.events.resync(instance_id, ResyncReason.INACCURATE)
            except Exception:  # noqa: BLE001 - see the docstring
                log.exception("evaluating the KV sources of the %s pool failed; evaluating again", self.view.component)

    def add_load_listener(self, listener: Callable[[str], None]) -> None:
        self._load_listeners.append(listener)

    def _load_changed(self, instance_id: str) -> None:
        for listener in self._load_listeners:
            listener(instance_id)

    async def wait_synced(self, timeout_s: float) -> list[str]:
        """Waits until the index holds the cache of every worker known now (each one's first KV
        event batch arrived), or the timeout; returns the workers still not synced."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while pending := [w for w, s in self.workers.items() if not s.synced]:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return pending
            self._synced_changed.clear()
            try:
                await asyncio.wait_for(self._synced_changed.wait(), remaining)
            except TimeoutError:
                return [w for w, s in self.workers.items() if not s.synced]
        return []

    def candidates(self, model: str, lora_name: str = "") -> list[WorkerState]:
        """The workers serving the model (and its LoRA adapter `lora_name`, when one is named),
        less those whose address another worker answers at now (killed and replaced: their lease
        has not run out yet, but a request sent there would reach the new worker under the old
        one's name)."""
        return [w for w in self.workers.values()
                if w.info.model == model and not w.replaced and (not lora_name or w.knows_adapter(lora_name))]

    def block_size(self, model: str) -> int | None:
        return self._block_size_by_model.get(model)

    def admit(self, instance_id: str, info: InstanceInfo) -> bool:
        """Adds a worker to the pool, or updates a known one's record, without following it.

        Returns True only for a worker new to the pool (the caller then follows its streams).
        A worker whose block size differs from the one its model is served with is refused:
        its blocks would hash differently, and so be mis-scored against every prompt.
        """
        expected = self._block_size_by_model.setdefault(info.model, info.block_size)
        if info.block_size != expected:
            log.error("worker %s has block size %d, but model %r is served with %d: refusing it (its KV blocks "
                      "would be mis-scored)", instance_id, info.block_size, info.model, expected)
            return False
        state = self.workers.get(instance_id)
        if state is not None:
            state.info = info
            return False
        self.workers[instance_id] = WorkerState(info)
        return True

    def _on_change(self, instance_id: str, info: InstanceInfo | None) -> None:
        if info is None:
            self._forget(instance_id)
        elif self.admit(instance_id, info):
            self._follow(instance_id)
        self._load_changed(instance_id)

    def _follow(self, instance_id: str) -> None:
        loop = asyncio.get_running_loop()
        if self._monitor is None:
            self._monitor = loop.create_task(self._watch_sources(), name=f"kv-sources-{self.view.component}")
        state = self.workers[instance_id]
        publishes = state.info.kv_events
        self._metrics.source.labels(instance_id).set(0)
        # Each worker's series looked up once: routing sets the pending gauge on every request.
        state.load_reports = self._metrics.load_reports.labels(instance_id)  # at 0 until its first report
        state.pending_gauge = self._metrics.pending.labels(instance_id)
        self._sources.add(instance_id, publishes)
        self._load_tasks[instance_id] = loop.create_task(self._follow_metrics(instance_id), name=f"metrics-{instance_id}")
        if publishes and not self._sources.router_off:
            self.events.follow(state)
        elif not state.synced:  # nothing to wait for
            state.synced = True
            self._synced_changed.set()

    def _forget(self, instance_id: str) -> None:
        state = self.workers.pop(instance_id, None)
        self._synced_changed.set()  # one fewer worker to wait for
        task = self._load_tasks.pop(instance_id, None)
        if task is not None:  # ended by `stop` at the latest
            task.cancel()
            self._ending.add(task)
            task.add_done_callback(self._ending.discard)
        self.events.forget(instance_id)
        self.index.remove_worker(instance_id)
        self.predicted.forget(instance_id)
        self._sources.forget(instance_id)
        self.accuracy.forget(instance_id)
        self._metrics.forget(instance_id)
        self._metrics.forget_load(instance_id)
        if state is not None and not any(w.info.model == state.info.model for w in self.workers.values()):
            # The last worker of a model is gone: a new one may bring another block size.
            self._block_size_by_model.pop(state.info.model, None)

    def _stub(self, instance_id: str) -> tuple[WorkerState, worker_pb2_grpc.WorkerStub]:
        state = self.workers[instance_id]
        return state, worker_pb2_grpc.WorkerStub(self._channels.get(state.info.address))

    async def _follow_metrics(self, instance_id: str) -> None:
        while instance_id in self.workers:
            state, stub = self._stub(instance_id)
            try:
                async for load in stub.SubscribeMetrics(worker_pb2.SubscribeMetricsRequest()):
                    state.observe_load(load)
                    if state.load_reports is not None and state.pending_gauge is not None:
                        state.load_reports.inc()
                        state.pending_gauge.set(len(state.pending))
                    self._load_changed(instance_id)
            except grpc.aio.AioRpcError as exc:
                log.debug("metrics stream of %s broke: %s", instance_id, exc.code())
            except Exception:  # noqa: BLE001 - a bug here must not silently freeze this worker's load
                log.exception("following the load of %s failed; subscribing again", instance_id)
            await asyncio.sleep(RESUBSCRIBE_BACKOFF_S)

    async def stop(self) -> None:
        """Ends every task of the pool (safe to call twice)."""
        tasks = [*self._load_tasks.values(), *self._ending]
        if self._monitor is not None:
            tasks.append(self._monitor)
            self._monitor = None
        self._load_tasks.clear()
        await cancel_and_wait(*tasks)
        await self.events.stop()
