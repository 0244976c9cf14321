"""Loading and unloading LoRA adapters on the workers, for the gateway's admin endpoints.

A load goes to every decode and prefill worker of the base model (`Worker.LoadLoraAdapter`, one
call each, side by side, each with a deadline); an unload to every decode and prefill worker. What
each worker answers is one `WorkerAnswer` (from its gRPC status), and one rule turns the answers
into the outcome of the whole operation (`load_outcome`, `unload_outcome`):

- load: a worker that finds the adapter invalid or its name taken by another path refuses the
  whole load (INVALID, CONFLICT; the workers that took it only now let go of it again, so no two
  workers serve one name from two paths); else the adapter is loaded when a decode worker took it
  (LOADED); else it is UNREACHABLE when a worker did not answer, LORA_OFF when none serves LoRA.
  Workers started without LoRA are skipped.
- unload: REMOVED when a worker forgot it, else UNREACHABLE when one did not answer, else UNKNOWN.

A load that succeeded is also kept in etcd (`runtime_adapter_key`, no lease), and an unload
removes it, so a worker that starts later (or restarts) serves the adapter too.

A worker writes the adapters it knows into its etcd record; after a load or an unload the gateway
waits (at most `VIEW_WAIT_S`) until its own view of the records shows the change, so a request sent
right after the answer resolves the adapter as the answer said.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc

from gen.kvmesh.v1 import worker_pb2, worker_pb2_grpc
from services.frontend.mesh import MeshView, ModelTarget
from services.mesh.channels import ChannelPool
from services.mesh.discovery import DECODE_WORKER, InstanceInfo, runtime_adapter_key, runtime_adapters_prefix
from services.mesh.etcd_store import KeyValueStore, StoreUnavailable

log = logging.getLogger(__name__)

# Each worker's call: registering an adapter reads its config and weights' sizes, not the weights.
WORKER_CALL_TIMEOUT_S = 10.0
# How long the gateway waits for its view of the records to show a load or an unload.
VIEW_WAIT_S = 5.0
# Writing or removing the runtime adapter's key in etcd.
STORE_TIMEOUT_S = 5.0


class WorkerAnswer(enum.Enum):
    """What one worker answered a load or an unload (worker.proto names the statuses)."""

    ACCEPTED = "accepted"
    LORA_OFF = "lora_off"  # FAILED_PRECONDITION: started without --enable-lora
    INVALID = "invalid_adapter"  # INVALID_ARGUMENT: not an adapter the worker can use
    CONFLICT = "adapter_conflict"  # ALREADY_EXISTS: the name is taken by another path
    UNKNOWN = "unknown_adapter"  # NOT_FOUND: no adapter of that name (an unload)
    UNREACHABLE = "unreachable"  # anything else: gone, draining, past the deadline


_ANSWER_OF_STATUS = {
    grpc.StatusCode.OK: WorkerAnswer.ACCEPTED,
    grpc.StatusCode.FAILED_PRECONDITION: WorkerAnswer.LORA_OFF,
    grpc.StatusCode.INVALID_ARGUMENT: WorkerAnswer.INVALID,
    grpc.StatusCode.ALREADY_EXISTS: WorkerAnswer.CONFLICT,
    grpc.StatusCode.NOT_FOUND: WorkerAnswer.UNKNOWN,
}


@dataclass(frozen=True, slots=True)
class WorkerReply:
    worker: InstanceInfo
    answer: WorkerAnswer
    # The worker's own words for a refusal (the gRPC details); "" when it accepted.
    message: str = ""


class LoraOutcome(enum.Enum):
    """How a load or an unload ended, over all the workers asked."""

    LOADED = "loaded"
    REMOVED = "removed"
    INVALID = "invalid_adapter"
    CONFLICT = "adapter_conflict"
    LORA_OFF = "lora_disabled"
    UNKNOWN = "unknown_adapter"
    UNREACHABLE = "unreachable"


@dataclass(frozen=True, slots=True)
class LoraResult:
    outcome: LoraOutcome
    message: str
    # The workers that hold the adapter after a load (their ids).
    holders: tuple[str, ...] = ()


def load_outcome(name: str, replies: Sequence[WorkerReply]) -> LoraResult:
    """The load's outcome by the rule in the module docstring."""
    for refusal in (WorkerAnswer.INVALID, WorkerAnswer.CONFLICT):
        refused = [r for r in replies if r.answer is refusal]
        if refused:
            return LoraResult(LoraOutcome[refusal.name], _worker_words(refused[0]))
    holders = tuple(r.worker.instance_id for r in replies if r.answer is WorkerAnswer.ACCEPTED)
    if any(r.answer is WorkerAnswer.ACCEPTED and r.worker.component == DECODE_WORKER for r in replies):
        return LoraResult(LoraOutcome.LOADED, f"Success: LoRA adapter '{name}' added successfully.", holders)
    unreachable = [r for r in replies if r.answer is WorkerAnswer.UNREACHABLE]
    if unreachable:
        return LoraResult(LoraOutcome.UNREACHABLE, f"no decode worker took LoRA adapter {name!r}: "
                          f"{len(unreachable)} did not answer ({_worker_words(unreachable[0])})")
    return LoraResult(LoraOutcome.LORA_OFF, "no worker serves LoRA adapters (start workers with --enable-lora)")


def unload_outcome(name: str, replies: Sequence[WorkerReply]) -> LoraResult:
    """The unload's outcome by the rule in the module docstring."""
    if any(r.answer is WorkerAnswer.ACCEPTED for r in replies):
        return LoraResult(LoraOutcome.REMOVED, f"Success: LoRA adapter '{name}' removed successfully.")
    unreachable = [r for r in replies if r.answer is WorkerAnswer.UNREACHABLE]
    if unreachable:
        return LoraResult(LoraOutcome.UNREACHABLE, f"LoRA adapter {name!r} was not removed: {len(unreachable)} "
                          f"workers did not answer ({_worker_words(unreachable[0])})")
    return LoraResult(LoraOutcome.UNKNOWN, f"the LoRA adapter {name[:200]!r} does not exist")


def _worker_words(reply: WorkerReply) -> str:
    return f"worker {reply.worker.instance_id}: {reply.message}" if reply.message else f"worker {reply.worker.instance_id}"


class LoraAdmin:
    """The gateway's hand on the workers' adapters (see the module docstring)."""

    def __init__(self, mesh: MeshView, channels: ChannelPool, call_timeout_s: float = WORKER_CALL_TIMEOUT_S,
                 view_wait_s: float = VIEW_WAIT_S, store: KeyValueStore | None = None, namespace: str = "") -> None:
        """`store`, `namespace`: where loads are kept for workers that start later (None: nowhere)."""
        self._mesh = mesh
        self._channels = channels
        self._store = store
        self._namespace = namespace
        self._call_timeout_s = call_timeout_s
        self._view_wait_s = view_wait_s
        # The path of each adapter this gateway loaded (the records name adapters, not paths).
        self.paths: dict[str, str] = {}

    async def load(self, target: ModelTarget, path: str) -> LoraResult:
        """Loads adapter `target.lora_name` from `path` on the workers of `target.base`."""
        name = target.lora_name
        workers = self._mesh.workers(target.base)
        request = worker_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
        replies = await asyncio.gather(*(self._call(w, "LoadLoraAdapter", request) for w in workers))
        result = load_outcome(name, replies)
        self._log(f"load of LoRA adapter {name!r} (base {target.base})", replies, result)
        if result.outcome in (LoraOutcome.INVALID, LoraOutcome.CONFLICT):
            await self._let_go(name, [r.worker for r in replies if r.answer is WorkerAnswer.ACCEPTED
                                      and name not in r.worker.lora_adapters])
        elif result.outcome is LoraOutcome.LOADED:
            self.paths[name] = path
            value = json.dumps({"model": target.base, "lora_name": name, "lora_path": path}).encode()
            await self._keep(name, lambda store: store.put(runtime_adapter_key(self._namespace, target.base, name), value))
            await self._until_shown(target, listed=True)
        return result

    async def unload(self, name: str) -> LoraResult:
        """Unloads adapter `name` from every worker that knows it."""
        replies = await asyncio.gather(*(self._call(w, "UnloadLoraAdapter", worker_pb2.UnloadLoraAdapterRequest(
            lora_name=name)) for w in self._mesh.workers()))
        result = unload_outcome(name, replies)
        self._log(f"unload of LoRA adapter {name!r}", replies, result)
        if result.outcome is LoraOutcome.REMOVED:
            self.paths.pop(name, None)
            await self._keep(name, self._forget_runtime_adapter(name))
            for base in {r.worker.model for r in replies if r.answer is WorkerAnswer.ACCEPTED}:
                await self._until_shown(ModelTarget(base, name), listed=False)
        return result

    def _forget_runtime_adapter(self, name: str) -> Callable[[KeyValueStore], Awaitable[None]]:
        async def forget(store: KeyValueStore) -> None:
            entries, _ = await store.get_prefix(runtime_adapters_prefix(self._namespace))
            for entry in entries:
                if _kept_name(entry.value) == name:
                    await store.delete(entry.key)
        return forget

    async def _keep(self, name: str, change: Callable[[KeyValueStore], Awaitable[None]]) -> None:
        """Applies `change` to the kept runtime adapters; the workers have the adapter (or not)
        whatever etcd says, so a failure here costs only workers that start later: a WARNING."""
        if self._store is None:
            return
        try:
            await asyncio.wait_for(change(self._store), STORE_TIMEOUT_S)
        except (StoreUnavailable, TimeoutError) as exc:
            log.warning("LoRA adapter %r: could not keep it for workers that start later: %s", name,
                        exc or "etcd timed out")

    async def _call(self, worker: InstanceInfo, method: str, request: object) -> WorkerReply:
        stub = worker_pb2_grpc.WorkerStub(self._channels.get(worker.address))
        try:
            await getattr(stub, method)(request, timeout=self._call_timeout_s)
        except grpc.aio.AioRpcError as exc:
            answer = _ANSWER_OF_STATUS.get(exc.code(), WorkerAnswer.UNREACHABLE)
            details = exc.details() or ""
            return WorkerReply(worker, answer, details if answer is not WorkerAnswer.UNREACHABLE
                               else f"{exc.code().name} {details}".strip())
        return WorkerReply(worker, WorkerAnswer.ACCEPTED)

    async def _let_go(self, name: str, workers: Sequence[InstanceInfo]) -> None:
        """Unloads a refused adapter from the workers that took it only now (best effort: one
        that does not answer keeps it until it is unloaded again)."""
        request = worker_pb2.UnloadLoraAdapterRequest(lora_name=name)
        replies = await asyncio.gather(*(self._call(w, "UnloadLoraAdapter", request) for w in workers))
        for reply in replies:
            if reply.answer is not WorkerAnswer.ACCEPTED:
                log.warning("LoRA adapter %r stays on worker %s after a refused load: %s %s", name,
                            reply.worker.instance_id, reply.answer.value, reply.message)

    async def _until_shown(self, target: ModelTarget, listed: bool) -> None:
        shown = await self._mesh.decoders.wait_for(lambda _: self._mesh.lists_adapter(target) == listed,
                                                   self._view_wait_s)
        if not shown:
            log.warning("LoRA adapter %r: the workers' records do not show it %s after %.0fs", target.lora_name,
                        "loaded" if listed else "unloaded", self._view_wait_s)

    @staticmethod
    def _log(what: str, replies: Sequence[WorkerReply], result: LoraResult) -> None:
        counts = {a: sum(r.answer is a for r in replies) for a in WorkerAnswer}
        summary = ", ".join(f"{n} {a.value}" for a, n in counts.items() if n) or "no worker asked"
        level = logging.WARNING if counts[WorkerAnswer.UNREACHABLE] else logging.INFO
        log.log(level, "%s: %s (%s)", what, result.outcome.value, summary)


def _kept_name(value: bytes) -> str | None:
    try:
        entry = json.loads(value)
    except ValueError:
        return None
    return entry.get("lora_name") if isinstance(entry, dict) else None
