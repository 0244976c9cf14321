"""An instance's etcd record (its `InstanceInfo`), and the one place it changes at run time.

A worker's record says what routers may send it: its pool (component and role) and the LoRA
adapters it knows. Both change at run time — a role switch moves the record to the other pool's
key, a `LoadLoraAdapter` or `UnloadLoraAdapter` changes its adapter list — and each change is
written from the record as it is now, one change at a time (under one lock), so a role switch
never puts back an adapter list that a load changed meanwhile, and a load never writes a record
under the pool the worker just left. A processor's record changes with the context length it
enforces (services/processor/context_limit.py).

Before the instance joins the mesh a change only changes the record in memory; joining puts the
record as it is then (`registered` puts it again if it changed during the registration).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any

from services.mesh.discovery import InstanceInfo, instance_key
from services.mesh.etcd_lease import LeasedRegistration
from services.mesh.etcd_store import StoreUnavailable

log = logging.getLogger(__name__)


class InstanceRecord:
    def __init__(self, info: InstanceInfo, namespace: str) -> None:
        self._info = info
        self._namespace = namespace
        self._registration: LeasedRegistration | None = None
        # What etcd holds (None before the instance joined): a write that failed is retried by the
        # next change, whatever it is.
        self._written: InstanceInfo | None = None
        self._lock = asyncio.Lock()

    @property
    def info(self) -> InstanceInfo:
        """The record as watchers see it (or will, once the instance joined the mesh and etcd answers)."""
        return self._info

    @property
    def is_registered(self) -> bool:
        return self._registration is not None

    def key(self, info: InstanceInfo | None = None) -> str:
        return instance_key(self._namespace, info or self._info)

    async def registered(self, registration: LeasedRegistration, sent: InstanceInfo) -> None:
        """The instance joined the mesh with `sent` under `registration`'s lease; a change made
        while it registered is written now."""
        async with self._lock:
            self._registration, self._written = registration, sent
            await self._write()

    async def update(self, **changes: Any) -> InstanceInfo:
        """Changes fields of the record and, once registered, writes it: in place, or moved to the
        new key when the component changed (a role switch). Raises StoreUnavailable when etcd does
        not take it (the record keeps an adapter change, which the next update writes; a move to another
        pool is undone, as the switch that asked for it failed)."""
        async with self._lock:
            previous = self._info
            self._info = replace(self._info, **changes)
            try:
                await self._write()
            except StoreUnavailable:
                if self._info.component != previous.component:
                    self._info = previous  # a switch that failed is no switch: its caller stays put
                raise
            return self._info

    async def _write(self) -> None:
        old, new = self._written, self._info
        if self._registration is None or old is None or new == old:
            return
        if self.key(old) == self.key(new):
            await self._registration.put(self.key(new), new.to_json())
        else:
            # The old key says "leaving" first, so watchers drop the worker from the old pool at
            # once (not after a grace period); the new key is put under the same lease.
            await self._registration.move(self.key(old), self.key(new), new.to_json(),
                                          replace(old, leaving=True).to_json())
        self._registration.farewell[self.key(new)] = replace(new, leaving=True).to_json()
        self._written = new
        log.info("%s %s record written (%s)", new.component, new.instance_id, _changed(old, new))


def _changed(old: InstanceInfo, new: InstanceInfo) -> str:
    names = [name for name in InstanceInfo.__dataclass_fields__ if getattr(old, name) != getattr(new, name)]
    return ", ".join(f"{name}={getattr(new, name)!r}" for name in names)
