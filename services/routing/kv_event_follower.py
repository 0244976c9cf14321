"""Following each worker's KV event stream into its pool's index, and keeping that view right or
rebuilding it.

One task per worker subscribes to its events (worker.proto SubscribeKvEvents), resuming from the
last event id after a broken stream, and applies each batch to the pool's index. The index must
be right, or say it is not:
- an event it cannot apply is counted by kind and reported (event_errors.py), and a worker whose
  events cannot be applied is rebuilt from a snapshot (a resubscription asking for one);
- so is a worker whose event ids jump (events lost on the way), one whose stream shows another
  incarnation without a snapshot (the worker restarted: ids start over), and one whose index the
  source monitor found inaccurate (kv_source.py; `resync`);
- every such resync goes through the ledger's limit (event_errors.py): one called for too soon
  waits, while the stream goes on being applied as well as it can, so a worker whose ids keep
  skipping costs one snapshot per interval, not one per batch;
- an address that now serves another worker (this one was killed, another took its port) drops
  this one's blocks at once, not when its lease runs out, and this one is followed no more: an
  instance id names one process, which is gone (every subscription there would only make the new
  worker build a snapshot to be thrown away). Its lease ends its record; meanwhile it is out of
  the pool's candidates and of the source monitor (its silence is not a lost stream).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, cast

import grpc

from gen.kvmesh.v1 import worker_pb2, worker_pb2_grpc
from services.kv_protocol.hashing import SequenceHash
from services.kv_protocol.tier import Tier
from services.mesh.channels import ChannelPool
from services.mesh.discovery import InstanceInfo
from services.mesh.tasks import cancel_and_wait
from services.routing.event_errors import EventErrorLedger, ResyncReason
from services.routing.kv_index import EventError, EventErrorKind, KvIndex, StoredBlock
from services.routing.kv_source import KvSourceTracker
from services.routing.router_metrics import KvTruthMetrics

log = logging.getLogger(__name__)

RESUBSCRIBE_BACKOFF_S = 0.5


class FollowedWorker(Protocol):
    """What the follower reads and sets of its pool's record of a worker (worker_pool.py WorkerState)."""

    info: InstanceInfo
    # The worker's address answers as another worker: this one is gone, its blocks dropped.
    replaced: bool
    # The index holds everything the worker had cached when this router subscribed to it.
    synced: bool


@dataclass(slots=True, eq=False)
class EventStream:
    """Where one worker's stream stands."""

    worker: FollowedWorker
    last_event_id: int = 0
    # The worker's event log `last_event_id` belongs to (0: none yet); new with each process.
    incarnation: int = 0
    # The next subscription asks for a snapshot (the index's view of the worker is wrong).
    want_snapshot: bool = False

    @property
    def instance_id(self) -> str:
        return self.worker.info.instance_id


class KvEventFollower:
    """The KV event streams of one pool's workers, into its index. `on_synced` is called when a
    worker becomes synced (the pool's `wait_synced` looks again)."""

    def __init__(self, index: KvIndex, channels: ChannelPool, metrics: KvTruthMetrics, sources: KvSourceTracker,
                 on_synced: Callable[[], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.index = index
        self._channels = channels
        self._metrics = metrics
        self._sources = sources
        self._on_synced = on_synced
        self._errors = EventErrorLedger(lambda w, kind, n: metrics.event_errors.labels(w, kind.value).inc(n), clock)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # Tasks of workers that left, cancelled and not yet ended (`stop` waits for them).
        self._ending: set[asyncio.Task[None]] = set()

    def follow(self, worker: FollowedWorker) -> None:
        instance_id = worker.info.instance_id
        self._tasks[instance_id] = asyncio.get_running_loop().create_task(self._follow(EventStream(worker)),
                                                                          name=f"kv-events-{instance_id}")

    def forget(self, instance_id: str) -> None:
        """The worker left its pool: its stream ends (`stop` waits for it), its errors go."""
        task = self._tasks.pop(instance_id, None)
        if task is not None:
            task.cancel()
            self._ending.add(task)
            task.add_done_callback(self._ending.discard)
        self._errors.forget(instance_id)

    def resync(self, instance_id: str, reason: ResyncReason) -> None:
        """The worker's view is wrong (found so by someone else: the source monitor): its stream
        starts over from a snapshot at its next batch, once the ledger's interval allows."""
        self._errors.call_for(instance_id, reason)

    async def stop(self) -> None:
        tasks = [*self._tasks.values(), *self._ending]
        self._tasks.clear()
        await cancel_and_wait(*tasks)

    async def _follow(self, stream: EventStream) -> None:
        """Subscribes to the worker's events until it is replaced (or it leaves: the task is cancelled)."""
        worker = stream.worker
        while True:
            if not stream.want_snapshot and (reason := self._errors.due(stream.instance_id)) is not None:
                self._start_resync(stream, reason)  # called for while the stream was down
            stub = worker_pb2_grpc.WorkerStub(self._channels.get(worker.info.address))
            request = worker_pb2.SubscribeKvEventsRequest(from_event_id=stream.last_event_id,
                                                          snapshot=stream.want_snapshot, incarnation=stream.incarnation)
            call = stub.SubscribeKvEvents(request)
            resyncing = False
            try:
                async for batch in call:
                    if not self.take_batch(stream, batch):
                        resyncing = not worker.replaced
                        break
                else:
                    log.debug("KV event stream of %s ended at id %d", stream.instance_id, stream.last_event_id)
            except grpc.aio.AioRpcError as exc:
                log.debug("KV event stream of %s broke at id %d: %s", stream.instance_id, stream.last_event_id,
                          exc.code())
            except Exception:  # noqa: BLE001 - a bug here must not silently freeze this worker's blocks
                log.exception("following the KV events of %s failed at id %d; subscribing again", stream.instance_id,
                              stream.last_event_id)
            finally:
                call.cancel()
            if worker.replaced:
                return
            if not resyncing:  # a resync resubscribes at once (the ledger bounds how often); a failure waits
                await asyncio.sleep(RESUBSCRIBE_BACKOFF_S)

    def take_batch(self, stream: EventStream, batch: worker_pb2.KvEventBatch) -> bool:
        """Applies one batch of the worker's stream; False ends the subscription (a snapshot is
        due, or the address serves another worker now)."""
        instance_id = stream.instance_id
        if batch.instance_id and batch.instance_id != instance_id:
            self._replaced(stream, batch.instance_id)
            return False
        self._sources.heard(instance_id)
        if batch.snapshot:
            restarted = stream.incarnation not in (0, batch.incarnation)
            if restarted:
                self._metrics.resyncs.labels(instance_id, ResyncReason.RESTART).inc()
            log.info("worker %s: rebuilding its blocks from a snapshot%s", instance_id,
                     " (it restarted)" if restarted else "")
            self.index.clear(instance_id)
            stream.want_snapshot = False
            self._errors.rebuilt(instance_id)
        elif (reason := self._errors.due(instance_id)) is not None:  # called for earlier, its interval now passed
            self._start_resync(stream, reason)
            return False
        elif batch.incarnation and stream.incarnation not in (0, batch.incarnation):
            # Another process that sent no snapshot: the old one's blocks went with it. Until the
            # snapshot may come, its events are applied from here.
            if self._called_for(stream, ResyncReason.RESTART):
                return False
            self.index.clear(instance_id)
            stream.last_event_id = 0
        if batch.incarnation:
            stream.incarnation = batch.incarnation
        for event in batch.events:
            if not batch.snapshot and stream.last_event_id and event.event_id > stream.last_event_id + 1:
                if self._called_for(stream, ResyncReason.GAP):  # events lost on the way
                    return False
            reason = self._apply(instance_id, event)
            stream.last_event_id = event.event_id
            if reason is not None:
                self._start_resync(stream, reason)
                return False
        if not stream.worker.synced:
            stream.worker.synced = True
            self._on_synced()
        return True

    def _replaced(self, stream: EventStream, by: str) -> None:
        worker = stream.worker
        log.info("worker %s: its address %s now serves worker %s; dropping its %d blocks and following it no more",
                 stream.instance_id, worker.info.address, by, self.index.block_count(stream.instance_id))
        worker.replaced = True
        self.index.clear(stream.instance_id)
        # Out of the source monitor: the silence that follows is not a lost stream.
        self._sources.forget(stream.instance_id)
        self._metrics.forget(stream.instance_id)
        self._errors.forget(stream.instance_id)
        if not worker.synced:
            worker.synced = True
            self._on_synced()

    def _called_for(self, stream: EventStream, reason: ResyncReason) -> bool:
        """Asks the ledger for a resync; True where it starts now (the subscription ends)."""
        self._errors.call_for(stream.instance_id, reason)
        due = self._errors.due(stream.instance_id)
        if due is None:
            log.debug("worker %s: a resync (%s) waits for the interval since the last", stream.instance_id, reason)
            return False
        self._start_resync(stream, due)
        return True

    def _start_resync(self, stream: EventStream, reason: ResyncReason) -> None:
        """The index's view of the worker is wrong: the next subscription asks for a snapshot."""
        log.warning("worker %s: rebuilding its blocks from a snapshot (%s)", stream.instance_id, reason)
        self._metrics.resyncs.labels(stream.instance_id, reason).inc()
        stream.want_snapshot = True

    def _apply(self, worker: str, event: worker_pb2.KvEvent) -> ResyncReason | None:
        """Applies an event; returns the reason to resync the worker now, if its errors call for one."""
        kind = event.WhichOneof("data")
        if kind == "stored":
            stored = event.stored
            # The wire carries both kinds of hash as plain u64s; their fields say which is which.
            parent = cast(SequenceHash, stored.parent_hash) if stored.HasField("parent_hash") else None
            blocks = cast("list[StoredBlock]", [(b.block_hash, b.tokens_hash) for b in stored.blocks])
            try:
                self.index.store(worker, parent, blocks, Tier.from_wire(stored.tier))
            except EventError as exc:
                log.debug("worker %s: %s", worker, exc)
                return self._errors.record(worker, exc.kind)
        elif kind == "removed":
            removed = event.removed
            named = removed.block_hashes
            held = self.index.remove(worker, cast("Iterable[SequenceHash]", named), Tier.from_wire(removed.tier))
            return self._errors.record(worker, EventErrorKind.UNKNOWN_BLOCK, len(named) - held)
        elif kind == "cleared":
            self.index.clear(worker)
        return None
