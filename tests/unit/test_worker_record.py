"""A worker's etcd record (services/mesh/instance_record.py) before it reaches etcd: its JSON form, and a
change made before the worker joined. What the record writes to etcd is tested against a real
etcd in tests/e2e/test_worker_record.py."""

from __future__ import annotations

from dataclasses import replace

from services.contract.worker_roles import RoleName
from services.mesh.discovery import DECODE_WORKER, InstanceInfo
from services.mesh.instance_record import InstanceRecord

NS = "rec"
INFO = InstanceInfo(component=DECODE_WORKER, instance_id="w1", address="127.0.0.1:1", model="m",
                    role=str(RoleName.DECODE), lora_adapters=("a",))


def test_the_adapter_list_round_trips_through_json_as_a_tuple() -> None:
    assert InstanceInfo.from_json(INFO.to_json()) == INFO
    assert InstanceInfo.from_json(b'{"component": "c", "instance_id": "i"}').lora_adapters == ()


async def test_a_change_before_joining_is_kept_in_memory_and_written_by_nothing() -> None:
    record = InstanceRecord(INFO, NS)
    assert await record.update(lora_adapters=("a", "b")) == replace(INFO, lora_adapters=("a", "b"))
    assert not record.is_registered and record.info.lora_adapters == ("a", "b")
