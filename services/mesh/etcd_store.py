"""The small key-value interface the mesh needs from etcd, implemented over `aetcd`.

Everything else talks to `KeyValueStore`, so the etcd client library stays replaceable and every
call has a deadline in one place.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar
from urllib.parse import urlsplit

import aetcd
import aetcd.exceptions
import aetcd.rpc
import aetcd.watcher
import grpc

from services.mesh.tls import TlsConfig

CALL_TIMEOUT_S = 5
T = TypeVar("T")
# gRPC backs off up to two minutes between reconnects by default: after an etcd outage the mesh
# would wait that long to register again. Retry within a second or two instead. (Not the
# "min" backoff: gRPC also uses it as the connect timeout, and etcd answers slowly at start-up.)
CHANNEL_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 250,
    "grpc.max_reconnect_backoff_ms": 2000,
    # Pings on idle streams, so a watch on a member that vanished without a word breaks (etcd
    # accepts pings every 5 s or more).
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
}


class StoreUnavailable(Exception):
    """etcd cannot be reached or answered with an error."""


class WatchNotConfirmed(StoreUnavailable):
    """etcd did not confirm a new watch in time. Routine on a busy machine (a vLLM engine loading
    starves the event loop for seconds): the connection is not taken for broken, and the caller
    sets the watch up again from a fresh listing."""


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
    def mark_broken(self) -> None: ...


def _host_port(endpoint: str) -> tuple[str, int]:
    parts = urlsplit(endpoint)
    return parts.hostname or "127.0.0.1", parts.port or 2379


class EtcdStore:
    """`KeyValueStore` over aetcd, failing over between the endpoints of a cluster.

    It talks to one endpoint at a time. A call that fails (or that a caller gave up on: see
    `mark_broken`) marks that connection broken and raises StoreUnavailable, which callers retry;
    the next call connects to the next endpoint that answers, round the list, so a dead cluster
    member costs one failed call. Whatever aetcd raises comes out as StoreUnavailable.

    `https://` endpoints are reached over TLS with the mesh certificate as the client
    certificate; one without a TLS setting is refused, never downgraded to plaintext.
    """

    def __init__(self, endpoints: tuple[str, ...], timeout_s: int = CALL_TIMEOUT_S,
                 tls: TlsConfig | None = None) -> None:
        self._endpoints = endpoints
        self._tls = tls
        self._timeout_s = timeout_s
        self._client: aetcd.Client | None = None
        self._current = 0
        self._broken = False
        self._reconnecting = asyncio.Lock()

    async def connect(self) -> None:
        """Connects and proves etcd answers, or raises StoreUnavailable naming the endpoints."""
        https = [e for e in self._endpoints if e.startswith("https://")]
        if https and self._tls is None:
            raise StoreUnavailable(f"{https[0]} needs TLS: pass --tls-cert, --tls-key and --tls-ca; refusing to "
                                   "speak plaintext to an https:// endpoint")
        errors = []
        for step in range(len(self._endpoints)):
            index = (self._current + step) % len(self._endpoints)
            endpoint = self._endpoints[index]
            host, port = _host_port(endpoint)
            client = self._client_for(endpoint, host, port)
            try:
                await asyncio.wait_for(client.connect(), self._timeout_s)
                await asyncio.wait_for(client.status(), self._timeout_s)
            except (TimeoutError, aetcd.exceptions.ClientError, OSError) as exc:
                errors.append(f"{endpoint}: {type(exc).__name__} {exc}".strip())
                await client.close()
                continue
            except BaseException:  # cancelled mid-connect: the new channel must not leak
                await client.close()
                raise
            old, self._client, self._current, self._broken = self._client, client, index, False
            if old is not None:
                await old.close()
            return
        raise StoreUnavailable("etcd unreachable at " + "; ".join(errors))

    def _client_for(self, endpoint: str, host: str, port: int) -> aetcd.Client:
        if endpoint.startswith("https://"):
            assert self._tls is not None
            return _TlsClient(self._tls.channel_credentials(), host=host, port=port, timeout=self._timeout_s,
                              options=CHANNEL_OPTIONS)
        return aetcd.Client(host=host, port=port, timeout=self._timeout_s, options=CHANNEL_OPTIONS)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def _ready(self) -> aetcd.Client:
        """The connected client, after moving to the next endpoint if the last call failed."""
        if self._client is None:
            raise StoreUnavailable("etcd store used before connect()")
        if self._broken and len(self._endpoints) > 1:
            async with self._reconnecting:
                if self._broken:
                    self._current = (self._current + 1) % len(self._endpoints)
                    await self.connect()
        return self._client

    def mark_broken(self) -> None:
        """A caller's own deadline ran out on a call: treat the connection as failed."""
        self._broken = True

    def _failed(self, exc: BaseException, client: aetcd.Client) -> StoreUnavailable:
        """What a call or watch that raised `exc` on `client` raises: StoreUnavailable, except
        for the task's own cancellation, which is raised again as it is."""
        if isinstance(exc, asyncio.CancelledError) and _cancelled_here():
            raise exc
        # A call that failed on a client already replaced says nothing of the current one.
        if client is self._client:
            self._broken = True
        return StoreUnavailable(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)

    async def _call(self, op: Callable[[aetcd.Client], Awaitable[T]]) -> T:
        return await self._on(await self._ready(), op)

    async def _on(self, client: aetcd.Client, op: Callable[[aetcd.Client], Awaitable[T]]) -> T:
        try:
            return await op(client)
        except (asyncio.CancelledError, Exception) as exc:  # aetcd raises more than ClientError (its watcher)
            raise self._failed(exc, client) from exc

    async def put(self, key: str, value: bytes, lease_id: int | None = None) -> None:
        await self._call(lambda c: c.put(key.encode(), value, lease=lease_id))

    async def delete(self, key: str) -> None:
        await self._call(lambda c: c.delete(key.encode()))

    async def get(self, key: str) -> bytes | None:
        result = await self._call(lambda c: c.get(key.encode()))
        return None if result is None else result.value

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        result = await self._call(lambda c: c.get_prefix(prefix.encode()))
        items = [KeyValue(kv.key.decode(), kv.value) for kv in result]
        return items, result.header.revision

    async def watch_prefix(self, prefix: str, start_revision: int) -> AsyncIterator[WatchEvent]:
        client = await self._ready()
        try:
            watch = await client.watch_prefix(prefix.encode(), start_revision=start_revision)
        except aetcd.exceptions.WatchTimeoutError:
            raise WatchNotConfirmed(f"etcd did not confirm the watch on {prefix} in time") from None
        except (asyncio.CancelledError, Exception) as exc:  # see _on
            raise self._failed(exc, client) from exc
        try:
            async for event in watch:
                yield WatchEvent(event.kv.key.decode(), event.kv.value, event.kind == "DELETE")
        except (asyncio.CancelledError, Exception) as exc:  # see _on
            raise self._failed(exc, client) from exc
        else:
            # An etcd watch never ends by itself: its connection was closed (a failover).
            raise StoreUnavailable("the watch stream ended with its connection")
        finally:
            try:
                await asyncio.wait_for(watch.cancel(), self._timeout_s)
            except Exception:  # noqa: BLE001 - the stream is already gone; nothing to cancel
                pass

    async def grant_lease(self, ttl_s: int) -> int:
        lease = await self._call(lambda c: c.lease(ttl_s))
        return int(lease.id)

    async def keepalive(self, lease_id: int) -> int:
        """Refreshes a lease; returns its new TTL, <= 0 when etcd no longer knows it."""
        reply = await self._call(lambda c: c.refresh_lease(lease_id))
        return int(reply.TTL) if reply is not None else 0

    async def revoke_lease(self, lease_id: int) -> None:
        await self._call(lambda c: c.revoke_lease(lease_id))


def _cancelled_here() -> bool:
    """Whether a CancelledError is this task's own cancellation. Closing a gRPC channel cancels
    the calls in flight on it (the store closes the old client when it fails over to another
    endpoint); a call awaiting one gets a CancelledError nobody asked its task for, and that is a
    broken connection, not a cancellation to pass on. (A watch on it ends instead: see
    `watch_prefix`.) A real cancellation has raised `cancelling()` before it reaches the call."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


class _TlsClient(aetcd.Client):
    """aetcd's client on a TLS channel (aetcd 1.0 opens plaintext channels only).

    It builds the same stubs aetcd's `connect` builds, on a secure channel. Opening a channel
    does no I/O; the first call does the handshake and fails like any unreachable endpoint."""

    def __init__(self, credentials: grpc.ChannelCredentials, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._credentials = credentials

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        target = f"{self._host}:{self._port}"
        self.channel = grpc.aio.secure_channel(target, self._credentials, options=list(self._options.items()))
        self.kvstub = aetcd.rpc.KVStub(self.channel)
        self.clusterstub = aetcd.rpc.ClusterStub(self.channel)
        self.leasestub = aetcd.rpc.LeaseStub(self.channel)
        self.maintenancestub = aetcd.rpc.MaintenanceStub(self.channel)
        self._watcher = aetcd.watcher.Watcher(aetcd.rpc.WatchStub(self.channel), timeout=self._timeout,
                                              metadata=self.metadata)
        self._connected.set()
