"""The local connector: carries a plan out on a launcher's workers (`services.launch --planner local`).

A worker moved from a pool that shrinks to one that grows is switched (`RoleControl.SwitchRole`
on the worker: no start-up, its prefix cache kept); only what switching cannot cover is started
or stopped through the launcher (`LauncherControl`), as is every change of the encode pool (its
workers run an encoder-only engine and never switch). The workers chosen to switch or stop are
the least busy of their pool, read from each one's load stream, so the fewest requests wait
out a drain or get migrated.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from gen.kvmesh.v1 import launcher_pb2, launcher_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.mesh.channels import ChannelPool
from services.mesh.discovery import ComponentView, InstanceInfo
from services.contract.worker_roles import ROLE_OF, RoleName, role_name
from services.planner.connectors.base import ConnectorError
from services.planner.pools import ROLES, PoolSizes

log = logging.getLogger(__name__)

# A load stream sends its first report at once; a worker silent this long counts as busiest.
LOAD_READ_TIMEOUT_S = 2.0
# Starting a worker includes its engine start (minutes for vLLM); stopping includes its drain.
LAUNCHER_CALL_TIMEOUT_S = 600.0


class LocalConnector:
    name = "local"
    acts = True

    def __init__(self, launcher: str, channels: ChannelPool, prefill: ComponentView, decode: ComponentView,
                 drain_timeout_s: float, encode: ComponentView | None = None) -> None:
        self._launcher = launcher
        self._channels = channels
        self._views = {RoleName.PREFILL: prefill, RoleName.DECODE: decode}
        if encode is not None:
            self._views[RoleName.ENCODE] = encode
        self._drain_timeout_s = drain_timeout_s

    async def current(self) -> PoolSizes | None:
        return None  # the pools are what etcd shows: the workers register themselves

    async def apply(self, current: PoolSizes, desired: PoolSizes) -> int:
        shrinking = [r for r in ROLES if desired.of(r) < current.of(r)]
        growing = [r for r in ROLES if desired.of(r) > current.of(r)]
        switched = 0
        if shrinking and growing:
            source, target = shrinking[0], growing[0]
            count = min(current.of(source) - desired.of(source), desired.of(target) - current.of(target))
            switched = await self._switch(source, target, count)
            current = current.with_role(source, current.of(source) - switched)
            current = current.with_role(target, current.of(target) + switched)
        for role in self._views:
            change = desired.of(role) - current.of(role)
            if change > 0:
                await asyncio.gather(*(self._start(role) for _ in range(change)))
            elif change < 0:
                victims = await self._least_busy(role, -change)
                await asyncio.gather(*(self._stop(info) for info in victims))
        return switched

    async def close(self) -> None:
        return None

    async def _switch(self, source: RoleName, target: RoleName, count: int) -> int:
        movers = await self._least_busy(source, count, switchable=True)
        results = await asyncio.gather(*(self._switch_one(info, target) for info in movers), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        for failure in failures:
            log.warning("a role switch failed: %s", failure)
        return len(results) - len(failures)

    async def _switch_one(self, info: InstanceInfo, target: RoleName) -> None:
        stub = worker_pb2_grpc.RoleControlStub(self._channels.get(info.address))
        try:
            reply = await stub.SwitchRole(worker_pb2.SwitchRoleRequest(role=ROLE_OF[target]),
                                          timeout=self._drain_timeout_s + LOAD_READ_TIMEOUT_S + 10)
        except grpc.aio.AioRpcError as exc:
            raise ConnectorError(f"switching {info.instance_id} to {target}: {exc.code().name} {exc.details()}") from exc
        log.info("switched worker %s from %s to %s (%d calls finished, %d migrated)", info.instance_id,
                 role_name(reply.previous_role), role_name(reply.role), reply.finished, reply.ended)

    async def _start(self, role: RoleName) -> None:
        stub = launcher_pb2_grpc.LauncherControlStub(self._channels.get(self._launcher))
        try:
            reply = await stub.StartWorker(launcher_pb2.StartWorkerRequest(role=ROLE_OF[role]), timeout=LAUNCHER_CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            raise ConnectorError(f"the launcher at {self._launcher} did not start a {role} worker: "
                                 f"{exc.code().name} {exc.details()}") from exc
        log.info("started %s worker %s (pid %d)", role, " ".join(reply.instance_ids), reply.pid)

    async def _stop(self, info: InstanceInfo) -> None:
        stub = launcher_pb2_grpc.LauncherControlStub(self._channels.get(self._launcher))
        try:
            reply = await stub.StopWorker(launcher_pb2.StopWorkerRequest(instance_id=info.instance_id),
                                          timeout=LAUNCHER_CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            raise ConnectorError(f"the launcher at {self._launcher} did not stop worker {info.instance_id}: "
                                 f"{exc.code().name} {exc.details()}") from exc
        log.info("stopped %s worker %s (exit %d)", info.role, info.instance_id, reply.exit_code)

    async def _least_busy(self, role: RoleName, count: int, switchable: bool = False) -> list[InstanceInfo]:
        members = [i for i in self._views[role].instances.values() if i.switchable or not switchable]
        loads = await asyncio.gather(*(self._load(info) for info in members))
        ranked = sorted(zip(loads, members, strict=True), key=lambda pair: pair[0])
        return [info for _, info in ranked[:count]]

    async def _load(self, info: InstanceInfo) -> float:
        """Requests running and waiting on the worker, from the first report of its load stream."""
        stub = worker_pb2_grpc.WorkerStub(self._channels.get(info.address))
        call = stub.SubscribeMetrics(worker_pb2.SubscribeMetricsRequest(), timeout=LOAD_READ_TIMEOUT_S)
        try:
            first = await call.read()
        except grpc.aio.AioRpcError:
            return float("inf")
        finally:
            call.cancel()
        if first is grpc.aio.EOF:
            return float("inf")
        return float(first.request_active_slots + first.num_requests_waiting)
