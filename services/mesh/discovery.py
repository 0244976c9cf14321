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

from services.mesh.etcd_store import KeyValueStore, StoreUnavailable

log = logging.getLogger(__name__)

FRONTEND = "frontend"
PROCESSOR = "processor"
ROUTER = "kv-router"
DECODE_WORKER = "decode-worker"
PREFILL_WORKER = "prefill-worker"
COMPONENTS = (FRONTEND, PROCESSOR, ROUTER, DECODE_WORKER, PREFILL_WORKER)


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
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> InstanceInfo:
        data = json.loads(raw)
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)


def component_prefix(namespace: str, component: str) -> str:
    return f"/{namespace}/instances/{component}/"


def instance_key(namespace: str, info: InstanceInfo) -> str:
    return component_prefix(namespace, info.component) + info.instance_id


Listener = Callable[[str, InstanceInfo | None], None]


class ComponentView:
    """A live map instance_id -> InstanceInfo of one component, fed by an etcd watch.

    A broken watch is re-established from a fresh listing, so the view converges after etcd
    blips; listeners hear every add and remove (info None) as it happens.
    """

    def __init__(self, store: KeyValueStore, namespace: str, component: str) -> None:
        self._store = store
        self._prefix = component_prefix(namespace, component)
        self.component = component
        self.instances: dict[str, InstanceInfo] = {}
        self._listeners: list[Listener] = []
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()

    def add_listener(self, listener: Listener) -> None:
        """`listener` hears every member from now on, starting with those already known."""
        self._listeners.append(listener)
        for instance_id, info in list(self.instances.items()):
            listener(instance_id, info)

    async def start(self, sync_timeout_s: float = 10.0) -> None:
        self._task = asyncio.create_task(self._run(), name=f"watch-{self.component}")
        await asyncio.wait_for(self._synced.wait(), sync_timeout_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def wait_for(self, predicate: Callable[[dict[str, InstanceInfo]], bool], timeout_s: float) -> bool:
        """Waits until `predicate(instances)` holds; False on timeout."""
        async def _wait() -> None:
            async with self._changed:
                await self._changed.wait_for(lambda: predicate(self.instances))

        try:
            await asyncio.wait_for(_wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def _run(self) -> None:
        backoff = 0.2
        while True:
            try:
                items, revision = await self._store.get_prefix(self._prefix)
                self._replace({kv.key[len(self._prefix):]: kv.value for kv in items})
                await self._notify()
                self._synced.set()
                backoff = 0.2
                async for event in self._store.watch_prefix(self._prefix, revision + 1):
                    instance_id = event.key[len(self._prefix):]
                    if event.deleted:
                        self._remove(instance_id)
                    else:
                        self._upsert(instance_id, event.value)
                    await self._notify()
            except StoreUnavailable as exc:
                log.warning("watch on %s broke (%s); relisting", self._prefix, exc)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    def _replace(self, raw: dict[str, bytes]) -> None:
        for instance_id in list(self.instances):
            if instance_id not in raw:
                self._remove(instance_id)
        for instance_id, value in raw.items():
            self._upsert(instance_id, value)

    def _upsert(self, instance_id: str, value: bytes) -> None:
        try:
            info = InstanceInfo.from_json(value)
        except (ValueError, TypeError) as exc:
            log.warning("ignoring malformed registration %s%s: %s", self._prefix, instance_id, exc)
            return
        is_new = self.instances.get(instance_id) != info
        self.instances[instance_id] = info
        if is_new:
            log.info("%s %s joined at %s", self.component, instance_id, info.address)
            for listener in self._listeners:
                listener(instance_id, info)

    def _remove(self, instance_id: str) -> None:
        if self.instances.pop(instance_id, None) is not None:
            log.info("%s %s left", self.component, instance_id)
            for listener in self._listeners:
                listener(instance_id, None)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()
