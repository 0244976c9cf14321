"""A worker's etcd record has one owner (services/mesh/instance_record.py): every change — adapters
loaded at run time, a role switch — is written from the record as it is now, so no change
writes back another's stale fields. Against a real etcd: the lease is the real LeasedRegistration
over EtcdStore, what was written is read back from etcd and the order of the writes is etcd's own
history of the test's namespace, as a watcher sees it; the role switch is the real RoleSwitch over
in-process gRPC. Each test has a namespace of its own.

The outage test stops an etcd of its own (this module's) for a moment and starts it again on the
same ports and data, so the session's etcd, which other meshes may be using, never goes away."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing, asynccontextmanager

import aetcd
import grpc
import pytest

from gen.kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.contract.worker_roles import RoleName
from services.mesh.discovery import DECODE_WORKER, PREFILL_WORKER, InstanceInfo, component_prefix
from services.mesh.etcd_lease import LeasedRegistration
from services.mesh.etcd_store import EtcdStore, StoreUnavailable
from services.mesh.instance_record import InstanceRecord
from services.worker.role_switch import RoleSwitch
from tests.procs import Etcd
from tests.unit.in_process_grpc import serving

INFO = InstanceInfo(component=DECODE_WORKER, instance_id="w1", address="127.0.0.1:1", model="m",
                    role=str(RoleName.DECODE), lora_adapters=("a",))
MARKER = "history-marker/"


class Namespace:
    """A test's own namespace in a real etcd, and what etcd can tell of it."""

    def __init__(self, endpoint: str, store: EtcdStore) -> None:
        self.name = f"rec-{uuid.uuid4().hex[:8]}"
        self.endpoint = endpoint
        self.store = store
        self.start_revision = 0

    def key(self, component: str) -> str:
        return component_prefix(self.name, component) + "w1"

    async def stored(self, component: str) -> InstanceInfo:
        value = await self.store.get(self.key(component))
        assert value is not None, f"etcd holds no {self.key(component)}"
        return InstanceInfo.from_json(value)

    async def holds(self, component: str) -> bool:
        return await self.store.get(self.key(component)) is not None

    async def history(self) -> list[tuple[str, str, bytes]]:
        """Every put ("put", key, value) and delete ("delete", key, b"") under the namespace since
        the test began, in etcd's order: a watch from the test's first revision, read up to a
        marker key put now (the markers themselves left out)."""
        prefix = f"/{self.name}/"
        marker = f"{prefix}{MARKER}{uuid.uuid4().hex}"
        await self.store.put(marker, b"")
        out: list[tuple[str, str, bytes]] = []
        async with asyncio.timeout(10), aclosing(self.store.watch_prefix(prefix, self.start_revision)) as events:
            async for event in events:
                if event.key == marker:
                    return out
                if not event.key.startswith(prefix + MARKER):
                    out.append(("delete", event.key, b"") if event.deleted else ("put", event.key, event.value))
        raise AssertionError("the watch ended before the marker")

    async def lease_of(self, component: str) -> int:
        """The lease etcd holds the key under (0: none)."""
        client = aetcd.Client(host="127.0.0.1", port=int(self.endpoint.rsplit(":", 1)[1]), timeout=5)
        async with client:
            kv = await client.get(self.key(component).encode())
        assert kv is not None
        return int(kv.lease)


@asynccontextmanager
async def connected(endpoint: str) -> AsyncIterator[Namespace]:
    store = EtcdStore((endpoint,))
    await store.connect()
    try:
        ns = Namespace(endpoint, store)
        _, revision = await store.get_prefix(f"/{ns.name}/")
        ns.start_revision = revision + 1
        yield ns
    finally:
        await store.close()


@asynccontextmanager
async def joined_on(endpoint: str) -> AsyncIterator[tuple[InstanceRecord, Namespace, LeasedRegistration]]:
    """A record registered as the runtime does it: the lease puts the record, then the owner learns it."""
    async with connected(endpoint) as ns:
        record = InstanceRecord(INFO, ns.name)
        registration = LeasedRegistration(ns.store)
        sent = record.info
        await registration.start({record.key(): sent.to_json()})
        try:
            await record.registered(registration, sent)
            yield record, ns, registration
        finally:
            await registration.stop()


@pytest.fixture
async def joined(etcd: Etcd) -> AsyncIterator[tuple[InstanceRecord, Namespace, LeasedRegistration]]:
    async with joined_on(etcd.endpoint) as out:
        yield out


@pytest.fixture(scope="module")
def own_etcd() -> Iterator[Etcd]:
    """This module's own etcd, for the test that takes it away for a moment."""
    server = Etcd.start()
    yield server
    server.stop()


async def test_a_change_made_while_the_worker_registered_is_written_once_it_has(etcd: Etcd) -> None:
    async with connected(etcd.endpoint) as ns:
        record = InstanceRecord(INFO, ns.name)
        registration = LeasedRegistration(ns.store)
        sent = record.info
        await registration.start({record.key(): sent.to_json()})
        try:
            await record.update(lora_adapters=("a", "late"))  # an adapter loaded during the registration
            assert (await ns.stored(DECODE_WORKER)).lora_adapters == ("a",)
            await record.registered(registration, sent)
            assert (await ns.stored(DECODE_WORKER)).lora_adapters == ("a", "late")
        finally:
            await registration.stop()
        # The lease went with the registration, and the record with it.
        assert not await ns.holds(DECODE_WORKER)


async def test_an_adapter_change_is_put_in_place_with_a_matching_farewell(joined) -> None:  # noqa: ANN001
    record, ns, registration = joined
    await record.update(lora_adapters=("a", "b"))
    assert (await ns.stored(DECODE_WORKER)).lora_adapters == ("a", "b")
    assert await ns.lease_of(DECODE_WORKER) == registration.lease_id
    farewell = InstanceInfo.from_json(registration.farewell[ns.key(DECODE_WORKER)])
    assert farewell.leaving and farewell.lora_adapters == ("a", "b")
    writes = len(await ns.history())
    await record.update(lora_adapters=("a", "b"))  # nothing changed: nothing written
    assert len(await ns.history()) == writes


async def test_a_move_to_another_pool_says_leaving_on_the_old_key_then_puts_the_new_one(joined) -> None:  # noqa: ANN001
    record, ns, registration = joined
    await record.update(lora_adapters=("a", "b"))
    start = len(await ns.history())
    await record.update(component=PREFILL_WORKER, role=str(RoleName.PREFILL))
    history = (await ns.history())[start:]
    ops = [(op, k) for op, k, _ in history]
    assert ops == [("put", ns.key(DECODE_WORKER)), ("delete", ns.key(DECODE_WORKER)), ("put", ns.key(PREFILL_WORKER))]
    said = InstanceInfo.from_json(history[0][2])
    assert said.leaving and said.lora_adapters == ("a", "b")
    assert not await ns.holds(DECODE_WORKER)
    assert (await ns.stored(PREFILL_WORKER)).lora_adapters == ("a", "b")
    assert await ns.lease_of(PREFILL_WORKER) == registration.lease_id  # the same lease: it goes with the worker
    assert set(registration.farewell) == {ns.key(PREFILL_WORKER)}


@pytest.mark.timeout(120)
async def test_a_failed_write_is_written_by_the_next_change(own_etcd: Etcd) -> None:
    async with joined_on(own_etcd.endpoint) as (record, ns, _):
        await asyncio.to_thread(own_etcd.halt)  # etcd goes away: its process stops, its data stays
        try:
            with pytest.raises(StoreUnavailable):
                await record.update(lora_adapters=("a", "b"))
            assert record.info.lora_adapters == ("a", "b")  # the record keeps the change
        finally:
            await asyncio.to_thread(own_etcd.resume)  # the same member, ports and data
        # etcd is back (the worker's store answers again) and lacks the change: the write failed.
        assert (await answered(lambda: ns.stored(DECODE_WORKER), 30)).lora_adapters == ("a",)
        await record.update(lora_adapters=("a", "b"))  # the same list again: still written, etcd lacks it
        assert (await ns.stored(DECODE_WORKER)).lora_adapters == ("a", "b")


async def answered(call, timeout_s: float):  # noqa: ANN001, ANN201
    """`call()`'s result once etcd answers it, retried while it is unavailable (up to `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await call()
        except StoreUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def test_a_role_switch_keeps_the_adapters_loaded_since_the_worker_joined(joined) -> None:  # noqa: ANN001
    record, ns, _ = joined
    switch = RoleSwitch(RoleName.DECODE, drain_timeout_s=1.0)
    switch.registered(record)
    async with serving(worker_pb2_grpc.add_RoleControlServicer_to_server, switch) as address:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.RoleControlStub(channel)
            await record.update(lora_adapters=("a", "b"))  # loaded at run time, after joining
            await stub.SwitchRole(worker_pb2.SwitchRoleRequest(role=common_pb2.WORKER_ROLE_PREFILL), timeout=5)
            assert (await ns.stored(PREFILL_WORKER)).lora_adapters == ("a", "b")
            await record.update(lora_adapters=("b",))  # unloaded in the prefill pool
            await stub.SwitchRole(worker_pb2.SwitchRoleRequest(role=common_pb2.WORKER_ROLE_DECODE), timeout=5)
    back = await ns.stored(DECODE_WORKER)
    assert (back.component, back.role, back.lora_adapters) == (DECODE_WORKER, str(RoleName.DECODE), ("b",))
    assert not await ns.holds(PREFILL_WORKER) and switch.switches == 2
    # No write put back a stale adapter list: once the unload was written, every record etcd saw
    # lists what the worker had then, in either pool.
    lists = [InstanceInfo.from_json(v).lora_adapters for op, _, v in await ns.history() if op == "put"]
    unloaded = lists.index(("b",))
    assert set(lists[:unloaded]) == {("a",), ("a", "b")} and set(lists[unloaded:]) == {("b",)}, lists
