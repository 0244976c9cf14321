"""Several --etcd-endpoints fail over: a dead cluster member costs a call, not the registration,
and an https:// endpoint is refused rather than spoken to in plaintext."""

from __future__ import annotations

import asyncio

import pytest

from services.mesh.etcd_lease import LeaseConfig, LeasedRegistration
from services.mesh.etcd_store import EtcdStore, StoreUnavailable
from tests.procs import Etcd, EtcdCluster


async def test_a_dead_member_fails_over_to_the_next_endpoint_and_the_lease_lives_on() -> None:
    cluster = await asyncio.to_thread(EtcdCluster.start)
    store = EtcdStore(tuple(cluster.endpoints))
    registration = LeasedRegistration(store, LeaseConfig(ttl_s=3, retry_backoff_s=0.2))
    try:
        await store.connect()
        lease = await registration.start({"/failover/me": b"alive"})
        # The member the store talks to first is the first endpoint: stop it.
        await asyncio.to_thread(cluster.members[0].stop)
        for _ in range(50):  # one call may fail; the next one goes to another member
            try:
                value = await store.get("/failover/me")
                break
            except StoreUnavailable:
                await asyncio.sleep(0.1)
        assert value == b"alive"
        # Two more TTLs: the keep-alive kept the same lease through the other members.
        await asyncio.sleep(6)
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

    async def watch() -> None:
        async for _ in store.watch_prefix("/failover-watch/", 1):
            pass

    task = asyncio.create_task(watch())
    try:
        await asyncio.sleep(0.5)
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
