"""The worker's LoRA adapters, the parts that need no worker in the mesh: each refusal kind has its
gRPC status, a worker without LoRA refuses an adapter's request before its engine sees it, a stored
KV event carries its adapter, the adapters' Prometheus metrics, and the startup adapters' checks.

The engine is a stand-in with a real AdapterSet (tests/unit/adapter_engine.py). The adapter RPCs,
which also change the worker's record in etcd, are tested against a real etcd in
tests/e2e/test_worker_lora_rpcs.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gen.kvmesh.v1 import common_pb2, worker_pb2
from services.engines.lora import Adapter, AdapterError, AdapterErrorKind, AdapterSet, LoraConfig, LoraModule
from services.kv_protocol.events import KvStored
from services.mesh.session_kind import CallError
from services.worker.kv_event_log import KvEventLog, NumberedEvent
from services.worker.lora_adapters import ADAPTER_STATUS, check_startup_adapters
from services.worker.lora_collector import WorkerLoraCollector
from services.worker.servicer import WorkerServicer, event_to_proto
from tests.unit.adapter_engine import AdapterEngine, adapter_dir
from tests.unit.clocks import FakeClock

SAMPLING = common_pb2.SamplingParams(max_tokens=2)


def test_every_refusal_kind_has_its_own_grpc_status() -> None:
    assert set(ADAPTER_STATUS) == set(AdapterErrorKind)
    assert len(set(ADAPTER_STATUS.values())) == len(AdapterErrorKind)


def test_a_worker_without_lora_refuses_an_adapters_request_but_serves_the_base_model() -> None:
    servicer = WorkerServicer(AdapterEngine(None), "w1", KvEventLog())
    with pytest.raises(CallError) as refused:
        servicer.engine_request(worker_pb2.WorkerGenerateRequest(request_id="r", token_ids=[1], sampling=SAMPLING,
                                                                 lora_name="a"))
    assert refused.value.outcome == common_pb2.OUTCOME_MODEL_NOT_SERVED and "'a'" in refused.value.message
    base = servicer.engine_request(worker_pb2.WorkerGenerateRequest(request_id="r", token_ids=[1], sampling=SAMPLING))
    assert base.lora_name == ""


def test_a_stored_event_carries_its_adapter_on_the_wire_and_in_a_snapshot() -> None:
    stored = KvStored(None, ((11, 22),), lora_name="a")
    assert event_to_proto(NumberedEvent(1, stored)).stored.lora_name == "a"
    events = KvEventLog()
    events.append(stored)
    events.append(KvStored(11, ((12, 23),)))
    snapshot = [e.data for e in events.snapshot()[1:]]
    assert [(d.blocks, d.lora_name) for d in snapshot if isinstance(d, KvStored)] == [(((11, 22),), "a"),
                                                                                       (((12, 23),), "")]


class TimedLoader:
    """Loads take a set time on a fake clock: a quarter of a second for a, three quarters for b."""

    LOAD_S = {"a": 0.25, "b": 0.75}

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    async def load(self, adapter: Adapter) -> None:
        self.clock.advance(self.LOAD_S[adapter.name])

    async def unload(self, adapter: Adapter) -> None:
        self.clock.advance(10.0)  # not a load: never counted as load time


async def test_adapter_metrics_count_requests_loads_evictions_and_residency(tmp_path: Path) -> None:
    clock = FakeClock()
    adapters = AdapterSet(LoraConfig(enabled=True, max_loras=1), TimedLoader(clock), clock=clock)
    for name in ("a", "b"):
        adapters.register(name, adapter_dir(tmp_path, name))
    for name in ("a", "b", "a"):  # one slot: each switch evicts the other
        async with adapters.use(name):
            pass
    registry = CollectorRegistry()
    registry.register(WorkerLoraCollector(lambda: [("w1", "decode", adapters)]))

    def value(metric: str, name: str) -> float | None:
        return registry.get_sample_value(metric, {"worker_id": "w1", "role": "decode", "lora_name": name})

    assert [value("kvmesh_worker_lora_requests_total", n) for n in "ab"] == [2, 1]
    assert [value("kvmesh_worker_lora_loads_total", n) for n in "ab"] == [2, 1]
    assert [value("kvmesh_worker_lora_unloads_total", n) for n in "ab"] == [1, 1]
    assert [value("kvmesh_worker_lora_resident", n) for n in "ab"] == [1, 0]
    # a loaded twice, b once: the time each load took on the set's clock.
    assert [value("kvmesh_worker_lora_load_seconds_total", n) for n in "ab"] == [0.5, 0.75]
    assert registry.get_sample_value("kvmesh_worker_max_loras", {"worker_id": "w1", "role": "decode"}) == 1


def test_a_startup_adapter_the_engine_cannot_use_is_named_before_it_starts(tmp_path: Path) -> None:
    # The engines register the startup adapters themselves when built (test_mocker_lora.py,
    # test_vllm_lora.py); the check reads them as they will, before a slow engine start.
    bad = LoraConfig(enabled=True, modules=(LoraModule("x", str(tmp_path / "missing")),))
    with pytest.raises(AdapterError) as failed:
        check_startup_adapters(bad)
    assert failed.value.kind is AdapterErrorKind.INVALID and "'x'" in str(failed.value)
    check_startup_adapters(LoraConfig(enabled=True, modules=(LoraModule("a", adapter_dir(tmp_path, "a")),)))
