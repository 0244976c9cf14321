"""The worker's side of LoRA adapters: those named at start, loads and unloads asked for over
gRPC, what they look like on the wire, and how a request naming an adapter is refused.

The engine's `AdapterSet` (services/engines/lora.py) decides residency and loads an adapter on
demand; the worker only makes adapters known or forgotten and reports them. Each refusal has one
answer, by its named kind:

| AdapterErrorKind | LoadLoraAdapter / UnloadLoraAdapter | a request naming the adapter |
| ---------------- | ----------------------------------- | ---------------------------- |
| DISABLED         | FAILED_PRECONDITION                 | OUTCOME_MODEL_NOT_SERVED     |
| UNKNOWN          | NOT_FOUND                           | OUTCOME_MODEL_NOT_SERVED     |
| INVALID          | INVALID_ARGUMENT                    | (cannot happen)              |
| CONFLICT         | ALREADY_EXISTS                      | (cannot happen)              |
| BUSY             | RESOURCE_EXHAUSTED (`load` waited)  | OUTCOME_NO_CAPACITY (503)    |

OUTCOME_MODEL_NOT_SERVED is a 404 `model_not_found` at the gateway (outcomes.py), answered, not
moved: routers send an adapter's requests only to workers whose record lists it, so a worker that
does not know it was chosen by a stale view, and the gateway names the adapter to the client.
"""

from __future__ import annotations

import asyncio
import json
import logging

import grpc

from gen.kvmesh.v1 import common_pb2, worker_pb2
from services.engines.base import Engine
from services.engines.lora import AdapterError, AdapterErrorKind, AdapterSet, AdapterState, LoraConfig, read_adapter
from services.mesh.discovery import runtime_adapters_prefix
from services.mesh.etcd_store import KeyValueStore, StoreUnavailable
from services.mesh.session_kind import CallError, bad_request

log = logging.getLogger(__name__)

# Reading the adapters loaded at run time, at start.
STORE_READ_S = 5.0

ADAPTER_STATUS: dict[AdapterErrorKind, grpc.StatusCode] = {
    AdapterErrorKind.DISABLED: grpc.StatusCode.FAILED_PRECONDITION,
    AdapterErrorKind.UNKNOWN: grpc.StatusCode.NOT_FOUND,
    AdapterErrorKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    AdapterErrorKind.CONFLICT: grpc.StatusCode.ALREADY_EXISTS,
    AdapterErrorKind.BUSY: grpc.StatusCode.RESOURCE_EXHAUSTED,  # LoadLoraAdapter(load=True) waiting for a slot
}


def adapter_set(engine: Engine, name: str = "") -> AdapterSet:
    """The engine's adapters; AdapterError(DISABLED) for an engine started without LoRA (naming
    the adapter `name` asked for, if any)."""
    if engine.adapters is None:
        about = f"the LoRA adapter {name!r} is not served: " if name else ""
        raise AdapterError(AdapterErrorKind.DISABLED, f"{about}this worker was started without LoRA (--enable-lora)")
    return engine.adapters


def known_adapters(engine: Engine) -> tuple[str, ...]:
    """The adapter names a worker's etcd record lists (sorted: a record that did not change
    compares equal)."""
    return () if engine.adapters is None else tuple(sorted(s.name for s in engine.adapters.states()))


def check_startup_adapters(config: LoraConfig) -> None:
    """Reads every `--lora-modules` adapter as the engine will (its config, rank and weights), so
    a bad one fails `--check-config` and fails before a slow engine start. Raises AdapterError."""
    for module in config.modules:
        read_adapter(module.name, module.path, config.max_lora_rank, int_id=0)


async def register_runtime_adapters(engine: Engine, store: KeyValueStore, namespace: str, model: str) -> None:
    """Makes the adapters loaded at run time through a gateway (kept in etcd, see
    services/frontend/lora_admin.py) known to a worker of `model` that starts after the load. One
    the worker cannot use, or etcd not answering, is a WARNING: the worker serves the rest."""
    if engine.adapters is None:
        return
    try:
        entries, _ = await asyncio.wait_for(store.get_prefix(runtime_adapters_prefix(namespace)), STORE_READ_S)
    except (StoreUnavailable, TimeoutError) as exc:
        log.warning("LoRA adapters loaded at run time not read (%s): this worker serves its --lora-modules only",
                    exc or "etcd timed out")
        return
    for entry in entries:
        try:
            kept = json.loads(entry.value)
            if kept.get("model") != model:
                continue
            engine.adapters.register(str(kept["lora_name"]), str(kept["lora_path"]))
        except AdapterError as exc:
            log.warning("LoRA adapter loaded at run time not served here: %s", exc)
        except (ValueError, KeyError, AttributeError):
            log.warning("a malformed runtime LoRA adapter entry at %s is ignored", entry.key)


def state_to_proto(state: AdapterState) -> worker_pb2.LoraAdapterState:
    return worker_pb2.LoraAdapterState(lora_name=state.name, lora_path=state.path, resident=state.resident,
                                       size_bytes=state.size_bytes, load_s=state.load_s,
                                       active_requests=state.active_requests)


def adapter_refused(exc: AdapterError) -> CallError:
    """A request naming an adapter this worker does not serve: OUTCOME_MODEL_NOT_SERVED, with the
    engine's message (which names the adapter)."""
    if exc.kind in (AdapterErrorKind.DISABLED, AdapterErrorKind.UNKNOWN):
        return CallError(common_pb2.OUTCOME_MODEL_NOT_SERVED, str(exc), "model")
    if exc.kind is AdapterErrorKind.BUSY:
        return CallError(common_pb2.OUTCOME_NO_CAPACITY, str(exc))
    return bad_request(str(exc), "model")


def check_adapter(engine: Engine, lora_name: str) -> None:
    """Refuses at once (adapter_refused) a request naming an adapter the worker does not know;
    a request of the base model ("") always passes."""
    if not lora_name:
        return
    try:
        adapter_set(engine, lora_name).get(lora_name)
    except AdapterError as exc:
        raise adapter_refused(exc) from None


async def load_adapter(engine: Engine, request: worker_pb2.LoadLoraAdapterRequest) -> AdapterState:
    """`LoadLoraAdapter`: makes the adapter known (idempotent for the same path), and resident now
    when asked. Raises AdapterError."""
    adapters = adapter_set(engine)
    if not request.lora_name or not request.lora_path:
        raise AdapterError(AdapterErrorKind.INVALID, "LoadLoraAdapter needs lora_name and lora_path")
    adapter = adapters.register(request.lora_name, request.lora_path)
    if request.load:
        await adapters.make_resident(adapter)
    return adapters.state(adapter)


async def unload_adapter(engine: Engine, request: worker_pb2.UnloadLoraAdapterRequest) -> AdapterState:
    """`UnloadLoraAdapter`: forgets the adapter; it is unloaded now, or when its last running
    request ends (the state says `resident` until then). Raises AdapterError."""
    adapters = adapter_set(engine)
    adapter = await adapters.unregister(request.lora_name)
    return adapters.state(adapter)
