"""An instance's registration in etcd: keys held under a lease that is kept alive.

When the process dies the lease expires (TTL) and every watcher forgets the instance. When etcd
blips and the lease is lost while the process lives, the registration grants a new lease and puts
its keys again; it never takes the service down.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from services.mesh.etcd_store import KeyValueStore, StoreUnavailable
from services.mesh.tasks import cancel_and_wait

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaseConfig:
    ttl_s: int = 10
    # Refresh three times per TTL: two refreshes can be lost before the lease lapses.
    refreshes_per_ttl: int = 3
    retry_backoff_s: float = 0.5


class LeasedRegistration:
    """Holds keys under one etcd lease for the life of the owning service."""

    def __init__(self, store: KeyValueStore, config: LeaseConfig = LeaseConfig()) -> None:
        self._store = store
        self._config = config
        self._keys: dict[str, bytes] = {}
        self._lease_id: int | None = None
        self._task: asyncio.Task[None] | None = None
        self.registrations = 0  # how many times the keys were (re)put under a fresh lease
        # Put on stop, before the lease is revoked (its owner's "leaving" records; see stop).
        self.farewell: dict[str, bytes] = {}

    @property
    def lease_id(self) -> int | None:
        return self._lease_id

    async def start(self, keys: dict[str, bytes]) -> int:
        """Grants the lease and puts the keys; raises StoreUnavailable if etcd is down now."""
        self._keys = dict(keys)
        await self._register()
        self._task = asyncio.create_task(self._keep_alive(), name="lease-keepalive")
        assert self._lease_id is not None
        return self._lease_id

    @property
    def keep_alive_task(self) -> asyncio.Task[None] | None:
        """Runs for the registration's life; it ends only by a bug, which its owner must hear of."""
        return self._task

    async def put(self, key: str, value: bytes) -> None:
        """Adds or replaces a key under the lease; it is re-put after a lease loss too."""
        self._keys[key] = value
        if self._lease_id is not None:
            await self._store.put(key, value, self._lease_id)

    async def move(self, old_key: str, new_key: str, value: bytes, farewell: bytes) -> None:
        """Replaces one key by another under the same lease (an instance changing component):
        the old key gets `farewell` (watchers drop it at once), is deleted, then the new key is
        put. The keep-alive's re-registrations hold the new key from here on."""
        self._keys.pop(old_key, None)
        self.farewell.pop(old_key, None)
        if self._lease_id is not None:
            await self._store.put(old_key, farewell, self._lease_id)
            await self._store.delete(old_key)
        await self.put(new_key, value)

    async def stop(self, farewell: dict[str, bytes] | None = None) -> None:
        """Cancels the keep-alive and revokes the lease so watchers forget us at once.

        `farewell` values are put first (best effort): a record saying "leaving" tells watchers
        this is a deliberate exit, not a lease lost to an outage."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        if self._lease_id is not None:
            try:
                for key, value in (self.farewell if farewell is None else farewell).items():
                    await asyncio.wait_for(self._store.put(key, value, self._lease_id), 2)
            except (TimeoutError, StoreUnavailable) as exc:
                log.warning("could not say farewell before revoking lease %x: %s", self._lease_id, exc)
            try:
                await asyncio.wait_for(self._store.revoke_lease(self._lease_id), 2)
            except (TimeoutError, StoreUnavailable) as exc:
                log.warning("could not revoke lease %x on shutdown: %s", self._lease_id, exc)
            self._lease_id = None

    async def _register(self) -> None:
        lease_id = await self._store.grant_lease(self._config.ttl_s)
        for key, value in self._keys.items():
            await self._store.put(key, value, lease_id)
        self._lease_id = lease_id
        self.registrations += 1

    async def _keep_alive(self) -> None:
        """Refreshes the lease a few times per TTL. A refresh that fails or hangs is retried
        after a short back-off rather than a whole period, each try bounded by the period, so
        one slow answer never costs the lease."""
        period = self._config.ttl_s / self._config.refreshes_per_ttl
        delay = period
        while True:
            await asyncio.sleep(delay)
            assert self._lease_id is not None
            try:
                ttl = await asyncio.wait_for(self._store.keepalive(self._lease_id), period)
            except (StoreUnavailable, TimeoutError) as exc:
                if isinstance(exc, TimeoutError):
                    self._store.mark_broken()  # the next try goes to another etcd endpoint
                log.warning("lease refresh failed (%s); retrying in %.1fs", exc or "timed out",
                            self._config.retry_backoff_s)
                delay = self._config.retry_backoff_s
                continue
            delay = period
            if ttl <= 0:
                log.warning("lease %x expired; registering again", self._lease_id)
                await self._reregister()

    async def _reregister(self) -> None:
        backoff = self._config.retry_backoff_s
        while True:
            try:
                await self._register()
                log.info("registered again under lease %x", self._lease_id)
                return
            except StoreUnavailable as exc:
                log.warning("re-registration failed (%s); retrying in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self._config.ttl_s / 2)
