"""The router's view of the workers of one role: who they are, their block size, their load.

Workers come from etcd; each one's load arrives over its SubscribeMetrics stream. The pool owns
one subscription task per worker and cancels it when the worker's lease goes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc

from gen.kvmesh.v1 import worker_pb2, worker_pb2_grpc
from services.common.discovery import ComponentView, InstanceInfo
from services.common.grpc_server import ChannelPool

log = logging.getLogger(__name__)

RESUBSCRIBE_BACKOFF_S = 0.5


@dataclass(slots=True)
class WorkerState:
    info: InstanceInfo
    load: worker_pb2.LoadMetrics = field(default_factory=worker_pb2.LoadMetrics)
    load_at: float = 0.0
    # Requests this router sent since the worker's last metrics: its own in-flight estimate.
    dispatched_since_load: int = 0


class WorkerPool:
    def __init__(self, view: ComponentView, channels: ChannelPool) -> None:
        self.view = view
        self._channels = channels
        self.workers: dict[str, WorkerState] = {}
        self.refused: dict[str, str] = {}
        self._block_size_by_model: dict[str, int] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        view.add_listener(self._on_change)

    def candidates(self, model: str) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.info.model == model]

    def block_size(self, model: str) -> int | None:
        return self._block_size_by_model.get(model)

    def _on_change(self, instance_id: str, info: InstanceInfo | None) -> None:
        if info is None:
            self._forget(instance_id)
            return
        expected = self._block_size_by_model.setdefault(info.model, info.block_size)
        if info.block_size != expected:
            reason = (f"worker {instance_id} has block size {info.block_size}, but model {info.model!r} is "
                      f"served with {expected}: refusing it (its KV blocks would be mis-scored)")
            log.error(reason)
            self.refused[instance_id] = reason
            return
        state = self.workers.get(instance_id)
        if state is None:
            self.workers[instance_id] = WorkerState(info)
            self._tasks[instance_id] = asyncio.get_running_loop().create_task(
                self._follow_metrics(instance_id), name=f"metrics-{instance_id}"
            )
        else:
            state.info = info

    def _forget(self, instance_id: str) -> None:
        self.refused.pop(instance_id, None)
        state = self.workers.pop(instance_id, None)
        task = self._tasks.pop(instance_id, None)
        if task is not None:
            task.cancel()
        if state is not None and not any(w.info.model == state.info.model for w in self.workers.values()):
            # The last worker of a model is gone: a new one may bring another block size.
            self._block_size_by_model.pop(state.info.model, None)

    async def _follow_metrics(self, instance_id: str) -> None:
        while instance_id in self.workers:
            state = self.workers[instance_id]
            stub = worker_pb2_grpc.WorkerStub(self._channels.get(state.info.address))
            try:
                async for load in stub.SubscribeMetrics(worker_pb2.SubscribeMetricsRequest()):
                    state.load = load
                    state.load_at = time.monotonic()
                    state.dispatched_since_load = 0
            except grpc.aio.AioRpcError as exc:
                log.debug("metrics stream of %s broke: %s", instance_id, exc.code())
            await asyncio.sleep(RESUBSCRIBE_BACKOFF_S)

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
