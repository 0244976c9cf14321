"""The launcher's worker pool under a local planner: one switchable worker per process, started
and stopped on request (the `LauncherControl` service the planner's local connector calls).

Each worker process is supervised like any child (restarted if it dies) until the planner
stops it; then its supervision ends first, so the stop is not taken for a crash. At teardown
every worker still running is drained and stopped, all at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from gen.kvmesh.v1 import launcher_pb2, launcher_pb2_grpc
from services.launch.children import Child
from services.launch.supervision import CHILD_EXIT_MARGIN_S, keep_running
from services.mesh.tasks import cancel_and_wait
from services.contract.worker_roles import RoleName, requested_role

log = logging.getLogger(__name__)

LAUNCHER_CONTROL_SERVICE = launcher_pb2.DESCRIPTOR.services_by_name["LauncherControl"].full_name
READY_POLL_S = 0.1


@dataclass
class _Worker:
    child: Child
    instance_ids: tuple[str, ...]
    supervision: asyncio.Task[None]


class WorkerControl(launcher_pb2_grpc.LauncherControlServicer):
    def __init__(self, make_child: Callable[[RoleName], Child], on_child_exit: str, drain_timeout_s: float,
                 ready_timeout_s: float, on_lost: Callable[[str], None]) -> None:
        self._make_child = make_child
        # Told when a worker's supervision ends by itself (`--on-child-exit exit`: the mesh stops).
        self._on_lost = on_lost
        self._policy = on_child_exit
        self._stop_s = drain_timeout_s + CHILD_EXIT_MARGIN_S
        self._ready_timeout_s = ready_timeout_s
        self._workers: list[_Worker] = []

    async def start(self, role: RoleName) -> _Worker:
        """Starts a worker in `role` and waits until it is registered; raises RuntimeError if it
        exits first, TimeoutError past the ready timeout (and stops it)."""
        child = self._make_child(role)
        await child.start()
        try:
            await asyncio.wait_for(_ready(child), self._ready_timeout_s)
        except BaseException:
            await child.stop(self._stop_s)
            raise
        ids = tuple(child.ready_message.split("ready:", 1)[1].split())
        task = asyncio.create_task(keep_running(child, self._policy), name=f"supervise-{child.component}")
        task.add_done_callback(lambda t: None if t.cancelled() else self._on_lost(f"the {child.component} process"))
        worker = _Worker(child, ids, task)
        self._workers.append(worker)
        return worker

    async def stop(self, instance_id: str) -> int:
        worker = next((w for w in self._workers if instance_id in w.instance_ids), None)
        if worker is None:
            raise KeyError(instance_id)
        self._workers.remove(worker)
        return await self._stop(worker)

    async def _stop(self, worker: _Worker) -> int:
        await cancel_and_wait(worker.supervision)
        await worker.child.stop(self._stop_s)
        return worker.child.returncode or 0

    async def stop_all(self) -> None:
        workers, self._workers = self._workers, []
        await asyncio.gather(*(self._stop(w) for w in workers))

    async def StartWorker(self, request: launcher_pb2.StartWorkerRequest,  # noqa: N802
                          context: grpc.aio.ServicerContext) -> launcher_pb2.StartWorkerResponse:
        role = await requested_role(request.role, context, tuple(RoleName))  # the encode pool too
        try:
            worker = await self.start(role)
        except (RuntimeError, TimeoutError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the {role} worker did not start: {exc}")
        log.info("started a %s worker on request: pid %s, %s", role, worker.child.process and
                 worker.child.process.pid, " ".join(worker.instance_ids))
        assert worker.child.process is not None
        return launcher_pb2.StartWorkerResponse(instance_ids=worker.instance_ids, pid=worker.child.process.pid)

    async def StopWorker(self, request: launcher_pb2.StopWorkerRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> launcher_pb2.StopWorkerResponse:
        try:
            code = await self.stop(request.instance_id)
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no worker process of this launcher hosts {request.instance_id}")
        log.info("stopped the worker %s on request (exit %d)", request.instance_id, code)
        return launcher_pb2.StopWorkerResponse(exit_code=code)


async def _ready(child: Child) -> None:
    while not child.ready:
        if child.returncode is not None:
            raise RuntimeError(f"{child.component} exited with code {child.returncode} before it was ready")
        await asyncio.sleep(READY_POLL_S)
