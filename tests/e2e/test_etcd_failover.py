"""Several --etcd-endpoints fail over: a dead cluster member costs a call, not the registration,
and an https:// endpoint is refused rather than spoken to in plaintext."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.mesh.etcd_lease import LeaseConfig, LeasedRegistration
from services.mesh.etcd_store import EtcdStore, StoreUnavailable
from tests.procs import Etcd, eventually


class RefreshCounting(EtcdStore):
    """The store, counting the lease refreshes etcd answered with the lease still alive."""

    refreshed = 0

    async def keepalive(self, lease_id: int) -> int:
        ttl = await super().keepalive(lease_id)
        if ttl > 0:
            self.refreshed += 1
        return ttl


async def _get_after_failover(store: EtcdStore, key: str, timeout_s: float = 5) -> bytes | None:
    """One call may fail on the dead member; the next one goes to another member."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await store.get(key)
        except StoreUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def test_a_dead_member_fails_over_to_the_next_endpoint_and_the_lease_lives_on() -> None:
    cluster = await asyncio.to_thread(Etcd.start, 3)
    store = RefreshCounting(tuple(cluster.endpoints))
    config = LeaseConfig(ttl_s=3, retry_backoff_s=0.2)
    registration = LeasedRegistration(store, config)
    try:
        await store.connect()
        lease = await registration.start({"/failover/me": b"alive"})
        # The member the store talks to first is the first endpoint: stop it.
        await asyncio.to_thread(cluster.procs[0].stop)
        assert await _get_after_failover(store, "/failover/me") == b"alive"
        # Refreshes through the other members, more than fit in one TTL (they are a period
        # apart): the lease outlived the TTL it had when the member stopped only by them.
        wanted = store.refreshed + config.refreshes_per_ttl + 1
        assert await eventually(lambda: store.refreshed >= wanted, 3 * config.ttl_s), store.refreshed
        assert await store.get("/failover/me") == b"alive"
        assert registration.lease_id == lease and registration.registrations == 1
    finally:
        await registration.stop()
        await store.close()
        await asyncio.to_thread(cluster.stop)


async def test_an_https_endpoint_is_refused_not_downgraded() -> None:
    store = EtcdStore(("https://127.0.0.1:2379",))
    with pytest.raises(StoreUnavailable, match="refusing to speak plaintext"):
        await store.connect()


async def test_a_watch_on_the_connection_a_failover_left_ends_as_unavailable_not_cancelled(etcd: Etcd) -> None:
    # Another call's deadline ran out (a keep-alive to a member that lost its quorum, say): the
    # store moves to the next endpoint and closes the old connection under the running watch.
    # The watch must end as a broken watch, which its owner relists, never as its task's cancellation.
    port = etcd.endpoint.rsplit(":", 1)[1]
    store = EtcdStore((f"http://127.0.0.1:{port}", f"http://localhost:{port}"))
    await store.connect()

    watching = asyncio.Event()

    async def watch() -> None:
        async for _ in store.watch_prefix("/failover-watch/", 1):
            watching.set()

    task = asyncio.create_task(watch())
    try:
        # The watch runs on the first connection once it delivers an event put there.
        await store.put("/failover-watch/started", b"")
        await asyncio.wait_for(watching.wait(), 10)
        store.mark_broken()
        await store.put("/failover-watch/k", b"v")  # goes to the next endpoint; the old one is closed
        with pytest.raises(StoreUnavailable, match="ended with its connection"):
            await asyncio.wait_for(task, 10)
        assert not task.cancelled()
        # A call whose future the closed connection cancelled is a failed call, not a cancellation.
        cancelled_under_it: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.1, cancelled_under_it.cancel)
        with pytest.raises(StoreUnavailable):
            await store._call(lambda client: cancelled_under_it)
        assert await store.get("/failover-watch/k") == b"v"  # and the store still answers
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await store.close()
