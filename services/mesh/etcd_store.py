"""The small key-value interface the mesh needs from etcd, implemented over `aetcd`.

Everything else talks to `KeyValueStore`, so the etcd client library stays replaceable and every
call has a deadline in one place.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import aetcd
import aetcd.exceptions

CALL_TIMEOUT_S = 5


class StoreUnavailable(Exception):
    """etcd cannot be reached or answered with an error."""


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: bytes


@dataclass(frozen=True, slots=True)
class WatchEvent:
    key: str
    value: bytes
    deleted: bool


class KeyValueStore(Protocol):
    async def connect(self) -> None: ...
    async def close(self) -> None: ...
    async def put(self, key: str, value: bytes, lease_id: int | None = None) -> None: ...
    async def delete(self, key: str) -> None: ...
    async def get(self, key: str) -> bytes | None: ...
    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]: ...
    def watch_prefix(self, prefix: str, start_revision: int) -> AsyncIterator[WatchEvent]: ...
    async def grant_lease(self, ttl_s: int) -> int: ...
    async def keepalive(self, lease_id: int) -> int: ...
    async def revoke_lease(self, lease_id: int) -> None: ...


def _host_port(endpoint: str) -> tuple[str, int]:
    parts = urlsplit(endpoint)
    return parts.hostname or "127.0.0.1", parts.port or 2379


class EtcdStore:
    """`KeyValueStore` over aetcd. Tries the endpoints in order until one answers."""

    def __init__(self, endpoints: tuple[str, ...], timeout_s: int = CALL_TIMEOUT_S) -> None:
        self._endpoints = endpoints
        self._timeout_s = timeout_s
        self._client: aetcd.Client | None = None

    async def connect(self) -> None:
        """Connects and proves etcd answers, or raises StoreUnavailable naming the endpoints."""
        errors = []
        for endpoint in self._endpoints:
            host, port = _host_port(endpoint)
            client = aetcd.Client(host=host, port=port, timeout=self._timeout_s)
            try:
                await asyncio.wait_for(client.connect(), self._timeout_s)
                await asyncio.wait_for(client.status(), self._timeout_s)
            except (TimeoutError, aetcd.exceptions.ClientError, OSError) as exc:
                errors.append(f"{endpoint}: {type(exc).__name__} {exc}".strip())
                await client.close()
                continue
            self._client = client
            return
        raise StoreUnavailable("etcd unreachable at " + "; ".join(errors))

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    @property
    def client(self) -> aetcd.Client:
        if self._client is None:
            raise StoreUnavailable("etcd store used before connect()")
        return self._client

    async def put(self, key: str, value: bytes, lease_id: int | None = None) -> None:
        try:
            await self.client.put(key.encode(), value, lease=lease_id)
        except aetcd.exceptions.ClientError as exc:
            raise StoreUnavailable(str(exc)) from exc

    async def delete(self, key: str) -> None:
        try:
            await self.client.delete(key.encode())
        except aetcd.exceptions.ClientError as exc:
            raise StoreUnavailable(str(exc)) from exc

    async def get(self, key: str) -> bytes | None:
        try:
            result = await self.client.get(key.encode())
        except aetcd.exceptions.ClientError as exc:
            raise StoreUnavailable(str(exc)) from exc
        return None if result is None else result.value

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        try:
            result = await self.client.get_prefix(prefix.encode())
        except aetcd.exceptions.ClientError as exc:
            raise StoreUnavailable(str(exc)) from exc
        items = [KeyValue(kv.key.decode(), kv.value) for kv in result]
        return items, result.header.revision

    async def watch_prefix(self, prefix: str, start_revision: int) -> AsyncIterator[WatchEvent]:
        try:
            watch = await self.client.watch_prefix(prefix.encode(), start_revision=start_revision)
        except aetcd.exceptions.ClientError as exc:
            raise StoreUnavailable(str(exc)) from exc
        try:
            async for event in watch:
                yield WatchEvent(event.kv.key.decode(), event.kv.value, event.kind == "DELETE")
        except aetcd.exceptions.ClientError as exc:
            raise StoreUnavailable(str(exc)) from exc
        finally:
            try:
                await asyncio.wait_for(watch.cancel(), self._timeout_s)
            except Exception:  # noqa: BLE001 - the stream is already gone; nothing to cancel
                pass

    async def grant_lease(self, ttl_s: int) -> int:
        try:
            lease = await self.client.lease(ttl_s)
        except aetcd.exceptions.ClientError as exc:
            raise StoreUnavailable(str(exc)) from exc
        return int(lease.id)

    async def keepalive(self, lease_id: int) -> int:
        """Refreshes a lease; returns its new TTL, <= 0 when etcd no longer knows it."""
        try:
            reply = await self.client.refresh_lease(lease_id)
        except aetcd.exceptions.ClientError as exc:
            raise StoreUnavailable(str(exc)) from exc
        return int(reply.TTL) if reply is not None else 0

    async def revoke_lease(self, lease_id: int) -> None:
        try:
            await self.client.revoke_lease(lease_id)
        except aetcd.exceptions.ClientError as exc:
            raise StoreUnavailable(str(exc)) from exc
