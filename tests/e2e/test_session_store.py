"""Session bindings shared through a real etcd (services/routing/session_store.py): two router
replicas, each with its own bindings and store, see each other's bindings, moves and moves back."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from services.mesh.etcd_store import EtcdStore
from services.mesh.tasks import cancel_and_wait
from services.routing.session_bindings import SessionBindings, SessionConfig, SessionKey
from services.routing.session_store import SessionStore, decode, sessions_prefix
from tests.procs import Etcd, eventually


class Replica:
    def __init__(self, store: EtcdStore, namespace: str) -> None:
        self.bindings = SessionBindings(SessionConfig(ttl_s=60.0))
        self.store = SessionStore(store, namespace, self.bindings)
        self.task = asyncio.create_task(self.store.run())

    def route(self, session: str, worker_id: str) -> None:
        """What a decision does: bind the session to the worker it chose."""
        key = SessionKey(session)
        self.bindings.bind(key, worker_id, self.bindings.preference(key, [worker_id]))


@pytest.fixture
async def replicas(etcd: Etcd) -> AsyncIterator[tuple[Replica, Replica, EtcdStore, str]]:
    store = EtcdStore((etcd.endpoint,))
    await store.connect()
    namespace = f"sessions-{uuid.uuid4().hex[:8]}"
    a, b = Replica(store, namespace), Replica(store, namespace)
    try:
        yield a, b, store, namespace
    finally:
        for replica in (a, b):
            await cancel_and_wait(replica.task)
        await store.close()


async def test_a_binding_made_on_one_replica_is_seen_by_the_other_and_so_are_moves_back(
        replicas: tuple[Replica, Replica, EtcdStore, str]) -> None:
    a, b, store, namespace = replicas
    a.route("s", "w1")
    assert await eventually(lambda: b.bindings.bound("s") == "w1", 5)
    b.route("s", "w2")  # moved on the other replica
    assert await eventually(lambda: a.bindings.bound("s") == "w2", 5)
    # Back to w1 on the first replica within its refresh period: it must write that again, though
    # it wrote the session's w1 binding moments ago.
    a.route("s", "w1")
    assert await eventually(lambda: b.bindings.bound("s") == "w1", 5)
    raw = await store.get(sessions_prefix(namespace) + "s")
    assert raw is not None and (binding := decode(raw)) is not None and binding.worker_id == "w1"


async def test_renewals_to_the_same_worker_are_not_written_every_request(
        replicas: tuple[Replica, Replica, EtcdStore, str]) -> None:
    a, b, store, namespace = replicas
    a.route("t", "w1")
    assert await eventually(lambda: b.bindings.bound("t") == "w1", 5)
    key = sessions_prefix(namespace) + "t"
    first = await store.get(key)
    for _ in range(5):
        a.route("t", "w1")
        await asyncio.sleep(0.05)
    assert await store.get(key) == first  # within refresh_s: the etcd copy stands
