"""The worker's LoRA adapter RPCs (services/worker/lora_adapters.py): each refusal has its status,
loads and unloads reach the engine's AdapterSet and the worker's record in a real etcd, a request
naming an unknown adapter ends at once with OUTCOME_MODEL_NOT_SERVED, and the adapters show in the
load metrics.

The engine is a stand-in with a real AdapterSet (tests/unit/adapter_engine.py: its loader only
records what it was asked); the servicer is the real WorkerServicer on an in-process gRPC server;
the worker's record is registered, as the runtime does it, under a real lease in the session's
etcd, in a namespace of each test's own. The parts that need no mesh are in
tests/unit/test_worker_lora.py."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from gen.kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.engines.lora import LoraConfig
from services.mesh.discovery import DECODE_WORKER, InstanceInfo
from services.mesh.etcd_lease import LeasedRegistration
from services.mesh.etcd_store import EtcdStore
from services.worker.kv_event_log import KvEventLog
from services.mesh.instance_record import InstanceRecord
from services.worker.servicer import WorkerServicer
from tests.procs import Etcd
from tests.unit.adapter_engine import AdapterEngine, adapter_dir
from tests.unit.in_process_grpc import serving

SAMPLING = common_pb2.SamplingParams(max_tokens=2)


@dataclass
class Worker:
    engine: AdapterEngine
    stub: worker_pb2_grpc.WorkerStub
    record: InstanceRecord
    store: EtcdStore

    async def listed(self) -> tuple[str, ...]:
        """The adapters the worker's record in etcd lists."""
        value = await self.store.get(self.record.key())
        assert value is not None, f"etcd holds no {self.record.key()}"
        return InstanceInfo.from_json(value).lora_adapters


@pytest.fixture
def lora_on() -> LoraConfig:
    return LoraConfig(enabled=True, max_loras=2, max_lora_rank=16)


async def running(etcd: Etcd, lora: LoraConfig | None) -> AsyncIterator[Worker]:
    engine = AdapterEngine(lora)
    servicer = WorkerServicer(engine, "w1", KvEventLog())
    store = EtcdStore((etcd.endpoint,))
    await store.connect()
    record = InstanceRecord(InstanceInfo(component=DECODE_WORKER, instance_id="w1"), f"lora-{uuid.uuid4().hex[:8]}")
    registration = LeasedRegistration(store)
    try:
        await registration.start({record.key(): record.info.to_json()})
        await record.registered(registration, record.info)
        servicer.record = record
        async with serving(worker_pb2_grpc.add_WorkerServicer_to_server, servicer) as address:
            async with grpc.aio.insecure_channel(address) as channel:
                yield Worker(engine, worker_pb2_grpc.WorkerStub(channel), record, store)
        await servicer.end_subscriptions()
    finally:
        await registration.stop()
        gone = await store.get(record.key()) is None
        await store.close()
    assert gone, "the lease went with the worker, and its record with it"


@pytest.fixture
async def worker(etcd: Etcd, lora_on: LoraConfig) -> AsyncIterator[Worker]:
    async for w in running(etcd, lora_on):
        yield w


@pytest.fixture
async def worker_without_lora(etcd: Etcd) -> AsyncIterator[Worker]:
    async for w in running(etcd, None):
        yield w


def load(name: str, path: str, now: bool = False) -> worker_pb2.LoadLoraAdapterRequest:
    return worker_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path, load=now)


async def refusal(call) -> grpc.aio.AioRpcError:  # noqa: ANN001
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await call
    return failed.value


async def test_a_worker_without_lora_refuses_to_load_with_failed_precondition(worker_without_lora: Worker,
                                                                               tmp_path: Path) -> None:
    w = worker_without_lora
    error = await refusal(w.stub.LoadLoraAdapter(load("a", adapter_dir(tmp_path, "a"))))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "--enable-lora" in (error.details() or "")
    assert await w.listed() == ()


async def test_an_adapter_it_cannot_use_is_invalid_argument_and_not_listed(worker: Worker, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for request in (load("a", str(tmp_path / "empty")), load("deep", adapter_dir(tmp_path, "deep", rank=64)),
                    load("", adapter_dir(tmp_path, "nameless"))):
        error = await refusal(worker.stub.LoadLoraAdapter(request))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert await worker.listed() == () and worker.engine.loader.calls == []


async def test_a_name_taken_by_another_path_is_already_exists(worker: Worker, tmp_path: Path) -> None:
    await worker.stub.LoadLoraAdapter(load("a", adapter_dir(tmp_path, "a")))
    error = await refusal(worker.stub.LoadLoraAdapter(load("a", adapter_dir(tmp_path, "other"))))
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS and "'a'" in (error.details() or "")
    assert await worker.listed() == ("a",)


async def test_unloading_an_unknown_adapter_is_not_found(worker: Worker) -> None:
    error = await refusal(worker.stub.UnloadLoraAdapter(worker_pb2.UnloadLoraAdapterRequest(lora_name="nope")))
    assert error.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in (error.details() or "")


async def test_a_loaded_adapter_is_listed_in_etcd_and_resident_only_when_loaded_now(worker: Worker,
                                                                                     tmp_path: Path) -> None:
    later = await worker.stub.LoadLoraAdapter(load("later", adapter_dir(tmp_path, "later", size=10_000)))
    assert (later.lora_name, later.resident, later.size_bytes) == ("later", False, 10_000) and later.load_s > 0
    now = await worker.stub.LoadLoraAdapter(load("now", adapter_dir(tmp_path, "now"), now=True))
    assert now.resident and now.load_s == 0
    assert worker.engine.loader.calls == [("load", "now")]
    assert await worker.listed() == ("later", "now")
    # Loading it again from the same path changes nothing.
    again = await worker.stub.LoadLoraAdapter(load("now", str(tmp_path / "now")))
    assert again.resident and await worker.listed() == ("later", "now")


async def test_an_unloaded_adapter_leaves_the_engine_and_the_record(worker: Worker, tmp_path: Path) -> None:
    await worker.stub.LoadLoraAdapter(load("a", adapter_dir(tmp_path, "a"), now=True))
    assert await worker.listed() == ("a",)
    gone = await worker.stub.UnloadLoraAdapter(worker_pb2.UnloadLoraAdapterRequest(lora_name="a"))
    assert gone.lora_name == "a" and not gone.resident
    assert worker.engine.loader.calls == [("load", "a"), ("unload", "a")]
    assert await worker.listed() == ()


async def test_a_request_runs_with_its_adapter_and_an_unknown_one_ends_model_not_served(worker: Worker,
                                                                                      tmp_path: Path) -> None:
    await worker.stub.LoadLoraAdapter(load("a", adapter_dir(tmp_path, "a")))
    request = worker_pb2.WorkerGenerateRequest(request_id="r1", token_ids=[1, 2, 3], sampling=SAMPLING, lora_name="a")
    replies = [r async for r in worker.stub.Generate(request, timeout=5)]
    assert replies[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert [r.lora_name for r in worker.engine.requests] == ["a"]
    assert worker.engine.adapters is not None and worker.engine.adapters.is_resident("a")  # loaded on demand

    unknown = worker_pb2.WorkerGenerateRequest(request_id="r2", token_ids=[1], sampling=SAMPLING, lora_name="zz")
    call = worker.stub.Generate(unknown, timeout=5)
    error = await refusal(call.read())
    assert error.code() == grpc.StatusCode.NOT_FOUND and "'zz'" in (error.details() or "")
    assert ("kvmesh-outcome", "OUTCOME_MODEL_NOT_SERVED") in tuple(error.trailing_metadata() or ())
    assert len(worker.engine.requests) == 1  # refused before the engine saw it


async def test_load_metrics_list_every_adapter_and_a_residency_change_is_pushed_at_once(worker: Worker,
                                                                                      tmp_path: Path) -> None:
    await worker.stub.LoadLoraAdapter(load("a", adapter_dir(tmp_path, "a")))
    stream = worker.stub.SubscribeMetrics(worker_pb2.SubscribeMetricsRequest())
    first = await stream.read()
    assert first.max_loras == 2
    assert [(s.lora_name, s.resident) for s in first.lora_adapters] == [("a", False)]
    await worker.stub.LoadLoraAdapter(load("a", str(tmp_path / "a"), now=True))
    # Well within the once-a-second push: the change itself is pushed.
    second = await stream.read()
    assert [(s.lora_name, s.resident, s.load_s) for s in second.lora_adapters] == [("a", True, 0.0)]
    stream.cancel()


async def test_a_worker_without_lora_reports_no_adapters_and_no_slots(worker_without_lora: Worker) -> None:
    stream = worker_without_lora.stub.SubscribeMetrics(worker_pb2.SubscribeMetricsRequest())
    first = await stream.read()
    assert (list(first.lora_adapters), first.max_loras) == ([], 0)
    stream.cancel()
