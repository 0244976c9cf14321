"""Live role switching: one engine, serving the prefill pool or the decode pool, moved by an RPC.

A switchable worker mounts both roles' services; a gate admits each call only in its role (a
call of the other role ends OUTCOME_PEER_DRAINING, which callers retry on another worker). `SwitchRole`:
1. closes the gate to the old role: new work of that role is refused from here on;
2. moves its etcd record to the other component under the same lease, marked "leaving" first,
   so routers drop it from the old pool at once and add it to the new one (routers, processors
   and decode workers see it within one watch round-trip);
3. opens the gate to the new role;
4. hands the decode role's requests over with their KV where the worker moves them
   (`hand_over`, worker/handoff.py: decode to prefill), lets work of the old role in flight
   finish until the deadline, then ends what is left with OUTCOME_PEER_DRAINING, which the
   processor migrates from as from a failed worker (the engine's output is deterministic, so the
   stream continues exactly where it stopped).
The engine and its prefix cache stay: nothing is reloaded, nothing restarted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
import grpc

from gen.kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.mesh.discovery import DECODE_WORKER, PREFILL_WORKER
from services.mesh.logs import LogComponent
from services.contract.worker_roles import ROLE_OF, RoleName, requested_role
from services.mesh.session_kind import CallError
from services.mesh.tasks import cancel_and_wait
from services.mesh.instance_record import InstanceRecord

log = logging.getLogger(__name__)

COMPONENT_OF = {RoleName.DECODE: DECODE_WORKER, RoleName.PREFILL: PREFILL_WORKER}
ROLE_CONTROL_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["RoleControl"].full_name


class _Ended(Exception):
    """Work the switch ended at its deadline."""


# Admits one call of a role for as long as the context lasts, or refuses it with a retryable
# CallError: how a role's servicer is gated when the worker can switch roles.
Admit = Callable[[RoleName], AbstractAsyncContextManager[None]]


@asynccontextmanager
async def always(role: RoleName) -> AsyncIterator[None]:
    """The admission of a worker that serves one role for good: every call."""
    yield


class RoleSwitch(worker_pb2_grpc.RoleControlServicer):
    def __init__(self, initial_role: RoleName, drain_timeout_s: float,
                 log_component: LogComponent | None = None) -> None:
        if initial_role not in COMPONENT_OF:
            raise ValueError(f"unknown role {initial_role!r}")
        # The process's log lines name the role it serves, from the start and after each switch.
        self._log_component = log_component or LogComponent(COMPONENT_OF[initial_role])
        self._log_component.name = COMPONENT_OF[initial_role]
        self.role: RoleName | None = initial_role
        self._registered_role = initial_role
        self._drain_timeout_s = drain_timeout_s
        self._record: InstanceRecord | None = None
        self._inflight: dict[RoleName, set[asyncio.Task[object]]] = {role: set() for role in RoleName}
        self._ending: set[asyncio.Task[object]] = set()
        self._lock = asyncio.Lock()
        self.switches = 0
        # Hands the decode calls in flight over to other workers (returns how many); None: they finish.
        self.hand_over: Callable[[], Awaitable[int]] | None = None

    @property
    def registered_role(self) -> RoleName:
        """The pool the worker is registered in (during a switch: the new one)."""
        return self._registered_role

    @property
    def component(self) -> str:
        return COMPONENT_OF[self._registered_role]

    def registered(self, record: InstanceRecord) -> None:
        """Called once the worker is in etcd: the record a switch moves (its one owner, so a
        switch writes the adapters the worker knows now, not those it knew at the start)."""
        self._record = record

    @asynccontextmanager
    async def work(self, role: RoleName) -> AsyncIterator[None]:
        """Admits one call of `role`, or refuses it (a retryable CallError); tracked so a switch
        can wait for it."""
        if self.role != role:
            raise CallError(common_pb2.OUTCOME_PEER_DRAINING,
                            f"this worker serves the {self.role or 'no'} role now, not {role}; retry elsewhere")
        task = asyncio.current_task()
        assert task is not None
        self._inflight[role].add(task)
        try:
            yield
        except asyncio.CancelledError:
            if task in self._ending:  # ended by a switch, not by the caller: make it retryable
                raise CallError(common_pb2.OUTCOME_PEER_DRAINING, f"this worker left the {role} role") from None
            raise
        finally:
            self._inflight[role].discard(task)
            self._ending.discard(task)

    async def SwitchRole(self, request: worker_pb2.SwitchRoleRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> worker_pb2.SwitchRoleResponse:
        target = await requested_role(request.role, context)
        if self._record is None or not self._record.is_registered:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is not registered yet")
        deadline_s = request.drain_timeout_s if request.drain_timeout_s > 0 else self._drain_timeout_s
        async with self._lock:  # one switch at a time
            previous = self._registered_role
            if previous == target:
                return worker_pb2.SwitchRoleResponse(previous_role=ROLE_OF[previous], role=request.role)
            finished, ended, handed = await self._switch(previous, target, deadline_s)
            return worker_pb2.SwitchRoleResponse(previous_role=ROLE_OF[previous], role=request.role, finished=finished,
                                                 ended=ended, handed_over=handed)

    async def _switch(self, previous: RoleName, target: RoleName, deadline_s: float) -> tuple[int, int, int]:
        assert self._record is not None
        started = time.monotonic()
        self.role = None
        new_info = await self._record.update(component=COMPONENT_OF[target], role=target)
        self._registered_role = target
        self._log_component.name = COMPONENT_OF[target]
        # The engine serves both kinds of work at once: the new role's calls are taken while
        # the old role's finish, so the worker is useful as soon as routers see it.
        self.role = target
        handed = await self._hand_over(previous, deadline_s)
        finished, ended = await self._drain(previous, max(0.0, deadline_s - (time.monotonic() - started)))
        self.switches += 1
        log.info("worker %s switched from %s to %s in %.2fs (%d calls handed over, %d finished, %d ended for "
                 "migration)", new_info.instance_id, previous, target, time.monotonic() - started, handed,
                 finished, ended)
        return finished, ended, handed

    async def _hand_over(self, role: RoleName, deadline_s: float) -> int:
        """The decode role's calls in flight handed over with their KV, where the worker can."""
        if role != RoleName.DECODE or self.hand_over is None or not self._inflight[role]:
            return 0
        try:
            return await asyncio.wait_for(self.hand_over(), deadline_s)
        except TimeoutError:
            log.warning("handing the decode calls over took past the %.1fs deadline; ending them instead", deadline_s)
            return 0

    async def _drain(self, role: RoleName, deadline_s: float) -> tuple[int, int]:
        """Waits for the old role's calls; ends those still running at the deadline."""
        calls = set(self._inflight[role])
        if not calls:
            return 0, 0
        _, pending = await asyncio.wait(calls, timeout=deadline_s)
        self._ending |= pending
        await cancel_and_wait(*pending)
        return len(calls) - len(pending), len(pending)
