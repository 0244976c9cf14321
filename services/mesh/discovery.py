"""Who is in the mesh: instance records in etcd and live views of each component.

Keys are `/<namespace>/instances/<component>/<instance_id>`; values are JSON `InstanceInfo`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from services.mesh.etcd_store import KeyValue, KeyValueStore, WatchEvent
from services.mesh.prefix_follow import follow_prefix
from services.mesh.tasks import cancel_and_wait

log = logging.getLogger(__name__)

FRONTEND = "frontend"
PROCESSOR = "processor"
ROUTER = "kv-router"
DECODE_WORKER = "decode-worker"
PREFILL_WORKER = "prefill-worker"
ENCODE_WORKER = "encode-worker"
PLANNER = "planner"
COMPONENTS = (FRONTEND, PROCESSOR, ROUTER, DECODE_WORKER, PREFILL_WORKER, PLANNER)


def new_instance_id() -> str:
    """16 hex digits: short enough for headers and logs, unique across restarts."""
    return secrets.token_hex(8)


@dataclass(frozen=True)
class InstanceInfo:
    component: str
    instance_id: str
    address: str = ""
    model: str = ""
    role: str = ""
    block_size: int = 0
    engine: str = ""
    metrics_port: int = 0
    # A worker that can change role (RoleControl.SwitchRole): a planner may move it between pools.
    switchable: bool = False
    # False: the worker publishes no KV events (`--kv-events off`); routers predict its cache.
    kv_events: bool = True
    # The LoRA adapters a worker knows (started with, or loaded at run time), by name: routers
    # send a request naming an adapter only to workers listing it.
    lora_adapters: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)
    # Put just before a deliberate deregistration: watchers drop the instance at once, where a
    # key that merely vanished may be an outage (see ComponentView).
    leaving: bool = False

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> InstanceInfo:
        data = json.loads(raw)
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        # JSON has no tuples; a frozen record compares equal only with its own tuple back.
        if "lora_adapters" in known:
            known["lora_adapters"] = tuple(known["lora_adapters"])
        return cls(**known)


def runtime_adapters_prefix(namespace: str) -> str:
    """Where the gateways keep the LoRA adapters loaded at run time (`/v1/load_lora_adapter`), one
    key each, with no lease: a worker that starts later learns them from here (see
    `runtime_adapter_key`)."""
    return f"/{namespace}/lora/"


def runtime_adapter_key(namespace: str, model: str, lora_name: str) -> str:
    """One runtime-loaded adapter of `model`; its value is JSON {"model", "lora_name", "lora_path"}
    (read the value, not the key: names may hold slashes)."""
    return f"{runtime_adapters_prefix(namespace)}{model}/{lora_name}"


def instances_prefix(namespace: str) -> str:
    """Where every instance of the mesh is registered, under its component."""
    return f"/{namespace}/instances/"


def component_prefix(namespace: str, component: str) -> str:
    return f"{instances_prefix(namespace)}{component}/"


def instance_key(namespace: str, info: InstanceInfo) -> str:
    return component_prefix(namespace, info.component) + info.instance_id


Listener = Callable[[str, InstanceInfo | None], None]
# How long a member stays after its key vanished when that may be an outage, not a death (see
# ComponentView): one lease TTL, three times what a live instance needs to register again.
REJOIN_GRACE_S = 10.0


class ComponentView:
    """A live map instance_id -> InstanceInfo of one component, fed by an etcd watch.

    A broken watch is re-established from a fresh listing, so the view converges after etcd
    blips; listeners hear every add and remove (info None) as it happens.

    When a member leaves: if it said so (a drain marks its record `leaving` before revoking its
    lease), or the watch reports its key deleted and other members remain, it leaves at once (a
    SIGKILLed worker's lease ran out). Otherwise — it was the last member, or
    a listing after a broken watch simply no longer shows it — it stays for `rejoin_grace_s`:
    after an etcd outage or a lost lease every live instance registers again within a third of
    its lease TTL, and until then an empty view would turn every request away for nothing.
    """

    def __init__(self, store: KeyValueStore, namespace: str, component: str,
                 rejoin_grace_s: float = REJOIN_GRACE_S) -> None:
        self._store = store
        self._prefix = component_prefix(namespace, component)
        self.component = component
        self.instances: dict[str, InstanceInfo] = {}
        self._listeners: list[Listener] = []
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()
        self._rejoin_grace_s = rejoin_grace_s
        # Members whose keys are gone, kept until their timer runs out unless they register again.
        self._leaving: dict[str, asyncio.TimerHandle] = {}

    def add_listener(self, listener: Listener) -> None:
        """`listener` hears every member from now on, starting with those already known."""
        self._listeners.append(listener)
        for instance_id, info in list(self.instances.items()):
            listener(instance_id, info)

    async def start(self, sync_timeout_s: float = 10.0) -> asyncio.Task[None]:
        """Lists and starts watching; returns the watch task (its owner watches it: it only ends
        by a bug, and a view that silently stopped following etcd would route to the dead)."""
        self._task = asyncio.create_task(self._run(), name=f"watch-{self.component}")
        await asyncio.wait_for(self._synced.wait(), sync_timeout_s)
        return self._task

    async def stop(self) -> None:
        for timer in self._leaving.values():
            timer.cancel()
        self._leaving.clear()
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def wait_for(self, predicate: Callable[[dict[str, InstanceInfo]], bool], timeout_s: float) -> bool:
        """Waits until `predicate(instances)` holds; False on timeout."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not predicate(self.instances):
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                return False
        return True

    async def _run(self) -> None:
        await follow_prefix(self._store, self._prefix, self._listed, self._watched)

    def _listed(self, items: list[KeyValue]) -> None:
        raw = {kv.key[len(self._prefix):]: kv.value for kv in items}
        for instance_id in list(self.instances):
            if instance_id not in raw:
                self._depart(instance_id, observed=False)
        for instance_id, value in raw.items():
            self._upsert(instance_id, value)
        self._synced.set()

    def _watched(self, event: WatchEvent) -> None:
        instance_id = event.key[len(self._prefix):]
        if event.deleted:
            self._depart(instance_id, observed=True)
        else:
            self._upsert(instance_id, event.value)

    def _upsert(self, instance_id: str, value: bytes) -> None:
        try:
            info = InstanceInfo.from_json(value)
        except (ValueError, TypeError) as exc:
            log.warning("ignoring malformed registration %s%s: %s", self._prefix, instance_id, exc)
            return
        timer = self._leaving.pop(instance_id, None)
        if timer is not None:
            timer.cancel()
            if not info.leaving:
                log.info("%s %s registered again", self.component, instance_id)
        if info.leaving:
            self._remove(instance_id)
            return
        is_new = self.instances.get(instance_id) != info
        self.instances[instance_id] = info
        if is_new:
            log.info("%s %s joined at %s", self.component, instance_id, info.address)
            for listener in self._listeners:
                listener(instance_id, info)
        self._signal()

    def _depart(self, instance_id: str, observed: bool) -> None:
        if instance_id not in self.instances or instance_id in self._leaving:
            return
        others = len(self.instances) - len(self._leaving) - 1
        if observed and others > 0:
            self._remove(instance_id)
            return
        log.info("%s %s is gone from etcd; kept for %.0fs in case it registers again", self.component,
                 instance_id, self._rejoin_grace_s)
        self._leaving[instance_id] = asyncio.get_running_loop().call_later(
            self._rejoin_grace_s, self._expire, instance_id)

    def _expire(self, instance_id: str) -> None:
        if self._leaving.pop(instance_id, None) is not None:
            self._remove(instance_id)

    def _remove(self, instance_id: str) -> None:
        if self.instances.pop(instance_id, None) is not None:
            log.info("%s %s left", self.component, instance_id)
            for listener in self._listeners:
                listener(instance_id, None)
        self._signal()

    def _signal(self) -> None:
        """Wakes every `wait_for`; each waits on the event current when it started waiting."""
        self._changed.set()
        self._changed = asyncio.Event()
