"""The router's view of the workers of one role: who they are, their cached blocks, their load.

Workers come from etcd. For each one the pool owns two subscription tasks — its KV events (into
the pool's radix tree, resuming from the last event id after a broken stream) and its load
metrics — and cancels both, dropping all the worker's blocks, when its lease goes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import cast

import grpc

from gen.kvmesh.v1 import worker_pb2, worker_pb2_grpc
from services.mesh.discovery import ComponentView, InstanceInfo
from services.mesh.channels import ChannelPool
from services.mesh.tasks import cancel_and_wait
from services.kv_protocol.hashing import SequenceHash
from services.kv_protocol.tier import Tier
from services.routing.kv_index import EventError, KvIndex, StoredBlock
from services.routing.radix_tree import RadixTree

log = logging.getLogger(__name__)

RESUBSCRIBE_BACKOFF_S = 0.5
# A dispatched request is counted as pending until a metrics report at least this much newer
# arrives: long enough for the request to have reached the worker's queue.
PENDING_GRACE_S = 0.05
MAX_PENDING = 4096
# How long a router (or a processor routing locally) waits for every worker's cached blocks
# before serving.
SYNC_TIMEOUT_S = 10.0


@dataclass(slots=True)
class WorkerState:
    info: InstanceInfo
    load: worker_pb2.LoadMetrics = field(default_factory=worker_pb2.LoadMetrics)
    last_event_id: int = 0
    # The index holds everything the worker had cached when this router subscribed to it.
    synced: bool = False
    # (dispatch time, new blocks) of requests this router sent that the worker has not reported yet.
    pending: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=MAX_PENDING))

    def add_pending(self, new_blocks: int) -> None:
        self.pending.append((time.monotonic(), new_blocks))

    def observe_load(self, load: worker_pb2.LoadMetrics) -> None:
        self.load = load
        horizon = time.monotonic() - PENDING_GRACE_S
        while self.pending and self.pending[0][0] < horizon:
            self.pending.popleft()

    def pending_counts(self) -> tuple[int, int]:
        return len(self.pending), sum(b for _, b in self.pending)


class WorkerPool:
    def __init__(self, view: ComponentView, channels: ChannelPool) -> None:
        self.view = view
        self.index: KvIndex = RadixTree()
        self._channels = channels
        self.workers: dict[str, WorkerState] = {}
        self._block_size_by_model: dict[str, int] = {}
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}
        self._synced_changed = asyncio.Event()
        # Called with the worker's id after every load report and membership change (admission:
        # room may have freed).
        self._load_listeners: list[Callable[[str], None]] = []
        view.add_listener(self._on_change)

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

    def candidates(self, model: str) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.info.model == model]

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
        self._tasks[instance_id] = [
            loop.create_task(self._follow_metrics(instance_id), name=f"metrics-{instance_id}"),
            loop.create_task(self._follow_events(instance_id), name=f"kv-events-{instance_id}"),
        ]

    def _forget(self, instance_id: str) -> None:
        state = self.workers.pop(instance_id, None)
        self._synced_changed.set()  # one fewer worker to wait for
        for task in self._tasks.pop(instance_id, []):
            task.cancel()
        self.index.remove_worker(instance_id)
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
                    self._load_changed(instance_id)
            except grpc.aio.AioRpcError as exc:
                log.debug("metrics stream of %s broke: %s", instance_id, exc.code())
            except Exception:  # noqa: BLE001 - a bug here must not silently freeze this worker's load
                log.exception("following the load of %s failed; subscribing again", instance_id)
            await asyncio.sleep(RESUBSCRIBE_BACKOFF_S)

    async def _follow_events(self, instance_id: str) -> None:
        while instance_id in self.workers:
            state, stub = self._stub(instance_id)
            try:
                request = worker_pb2.SubscribeKvEventsRequest(from_event_id=state.last_event_id)
                async for batch in stub.SubscribeKvEvents(request):
                    if batch.snapshot:
                        log.info("worker %s: rebuilding its blocks from a snapshot", instance_id)
                        self.index.clear(instance_id)
                    for event in batch.events:
                        self._apply(instance_id, event)
                        state.last_event_id = event.event_id
                    if not state.synced:
                        state.synced = True
                        self._synced_changed.set()
            except grpc.aio.AioRpcError as exc:
                log.debug("KV event stream of %s broke at id %d: %s", instance_id, state.last_event_id, exc.code())
            except Exception:  # noqa: BLE001 - a bug here must not silently freeze this worker's blocks
                log.exception("following the KV events of %s failed at id %d; subscribing again", instance_id,
                              state.last_event_id)
            await asyncio.sleep(RESUBSCRIBE_BACKOFF_S)

    def _apply(self, worker: str, event: worker_pb2.KvEvent) -> None:
        kind = event.WhichOneof("data")
        if kind == "stored":
            stored = event.stored
            # The wire carries both kinds of hash as plain u64s; their fields say which is which.
            parent = cast(SequenceHash, stored.parent_hash) if stored.HasField("parent_hash") else None
            blocks = cast("list[StoredBlock]", [(b.block_hash, b.tokens_hash) for b in stored.blocks])
            try:
                self.index.store(worker, parent, blocks, Tier.from_wire(stored.tier))
            except EventError as exc:
                log.debug("%s", exc)
        elif kind == "removed":
            removed = event.removed
            self.index.remove(worker, cast("Iterable[SequenceHash]", removed.block_hashes), Tier.from_wire(removed.tier))
        elif kind == "cleared":
            self.index.clear(worker)

    async def stop(self) -> None:
        tasks = [t for ts in self._tasks.values() for t in ts]
        self._tasks.clear()
        await cancel_and_wait(*tasks)
