"""LoRA adapters on a mesh of mocker workers (real processes, real etcd): each worker's record and
load metrics list its adapters, an adapter's requests go to the worker that holds it, at most
`--max-loras` stay loaded (least recently used out), adapters are loaded and unloaded at run time
over the worker's gRPC, and an adapter nobody serves is refused naming it."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest

from gen.kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.mesh.discovery import DECODE_WORKER, InstanceInfo
from services.tools.make_demo_adapter import write_stand_in_adapter
from testkit.metrics import by_labels, routers_heard_every_worker
from tests.procs import Etcd, ServiceMesh, registered, service, wait_until

MAX_LORAS = 2
STARTUP = ("a", "b", "c", "d", "e")
# About a 8B model's rank-8 adapter on q and v of 32 layers, in bytes: a load the router weighs.
ADAPTER_BYTES = 8 << 20


@dataclass
class LoraMesh:
    mesh: ServiceMesh
    ids: list[str]
    root: Path

    def info(self, worker_id: str) -> InstanceInfo:
        (info,) = [i for i in registered(self.mesh.etcd, self.mesh.namespace, DECODE_WORKER)
                   if i.instance_id == worker_id]
        return info

    def stub(self, worker_id: str) -> tuple[grpc.Channel, worker_pb2_grpc.WorkerStub]:
        channel = grpc.insecure_channel(self.info(worker_id).address)
        return channel, worker_pb2_grpc.WorkerStub(channel)

    def complete(self, model: str, seed: int) -> httpx.Response:
        """A request of `model` (an adapter's name, or the base model's) with a prompt of its own."""
        rng = random.Random(seed)
        prompt = [rng.randrange(20, 1000) for _ in range(40)]
        return httpx.post(self.mesh.url("/v1/completions"), timeout=30, headers={"x-kvmesh-explain": "1"},
                          json={"model": model, "prompt": prompt, "max_tokens": 2})

    def lora(self, metric: str) -> dict[tuple[str, ...], float]:
        """A per-adapter worker metric: (worker id, adapter) -> value, over the workers' process."""
        return by_labels(self.mesh.metrics(DECODE_WORKER), metric, "worker_id", "lora_name")


@pytest.fixture(scope="module")
def lora_mesh(etcd: Etcd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoraMesh]:
    root = tmp_path_factory.mktemp("adapters")
    modules = [f"{name}={write_stand_in_adapter(root / name, ADAPTER_BYTES)}" for name in STARTUP]
    with ServiceMesh(etcd.endpoint, router_mode="kv", frontend_flags=("--allow-explain",)) as mesh:
        _, ids = mesh.worker("--num-workers", "2", "--max-loras", str(MAX_LORAS), "--lora-modules", *modules)
        assert wait_until(lambda: mesh.complete().status_code == 200, 20)
        yield LoraMesh(mesh, ids, root)


def chosen(response: httpx.Response) -> str:
    """The chosen worker's section of the route header."""
    return response.headers["x-kvmesh-route"].split("; ")[1]


def test_each_worker_lists_its_adapters_in_etcd_and_in_its_load_metrics(lora_mesh: LoraMesh) -> None:
    for worker_id in lora_mesh.ids:
        assert lora_mesh.info(worker_id).lora_adapters == STARTUP
    channel, stub = lora_mesh.stub(lora_mesh.ids[0])
    with channel:
        metrics = next(iter(stub.SubscribeMetrics(worker_pb2.SubscribeMetricsRequest(), timeout=5)))
    assert metrics.max_loras == MAX_LORAS
    assert sorted(s.lora_name for s in metrics.lora_adapters) == list(STARTUP)
    assert all(s.size_bytes == ADAPTER_BYTES for s in metrics.lora_adapters)
    # More adapters than slots: some are not resident, and each of those says what loading it takes.
    cold = [s for s in metrics.lora_adapters if not s.resident]
    assert len(cold) >= len(STARTUP) - MAX_LORAS, metrics.lora_adapters
    assert all(s.load_s > 0 for s in cold)


def test_an_adapters_requests_go_to_the_worker_that_holds_it(lora_mesh: LoraMesh) -> None:
    before = lora_mesh.lora("kvmesh_worker_lora_loads_total")
    first = lora_mesh.complete("a", seed=1)
    assert first.status_code == 200, first.text
    assert first.json()["model"] == "a"
    home = first.headers["x-kvmesh-worker"]
    assert " lora=a" in first.headers["x-kvmesh-route"].split("; ")[0]
    for seed in range(2, 5):  # prompts sharing nothing: only the adapter draws them to `home`
        # Once every worker has reported its load since the last request, as a router sees it
        # between requests that are not a burst (a burst spreads an adapter: cost_function.py).
        assert wait_until(routers_heard_every_worker(lora_mesh.mesh.etcd, lora_mesh.mesh.namespace), 10)
        r = lora_mesh.complete("a", seed=seed)
        assert r.status_code == 200, r.text
        assert r.headers["x-kvmesh-worker"] == home, r.headers["x-kvmesh-route"]
        assert "adapter=resident" in chosen(r), r.headers["x-kvmesh-route"]
    loads = lora_mesh.lora("kvmesh_worker_lora_loads_total")
    assert loads[(home, "a")] - before.get((home, "a"), 0) == 1  # loaded once, then reused
    assert lora_mesh.lora("kvmesh_worker_lora_requests_total")[(home, "a")] >= 4
    assert lora_mesh.lora("kvmesh_worker_lora_resident")[(home, "a")] == 1


def test_no_worker_holds_more_than_max_loras_and_evicted_adapters_are_counted(lora_mesh: LoraMesh) -> None:
    for round_ in range(2):
        for i, name in enumerate(STARTUP):
            r = lora_mesh.complete(name, seed=100 + 10 * round_ + i)
            assert r.status_code == 200, r.text
            resident = lora_mesh.lora("kvmesh_worker_lora_resident")
            for worker_id in lora_mesh.ids:
                held = [n for (w, n), v in resident.items() if w == worker_id and v == 1]
                assert len(held) <= MAX_LORAS, held
    loads = lora_mesh.lora("kvmesh_worker_lora_loads_total")
    unloads = lora_mesh.lora("kvmesh_worker_lora_unloads_total")
    resident = lora_mesh.lora("kvmesh_worker_lora_resident")
    # Five adapters, four slots in all: at least one was loaded, then unloaded for another.
    assert sum(unloads.values()) >= 1
    # Every load ended in an unload or is resident still.
    for key, n in loads.items():
        assert n == unloads.get(key, 0) + resident.get(key, 0), key
    seconds = lora_mesh.lora("kvmesh_worker_lora_load_seconds_total")
    assert all(seconds[key] > 0 for key, n in loads.items() if n > 0)


def generate(stub: worker_pb2_grpc.WorkerStub, rid: str, lora_name: str) -> list[worker_pb2.WorkerGenerateResponse]:
    request = worker_pb2.WorkerGenerateRequest(request_id=rid, token_ids=[5, 6, 7, 8], lora_name=lora_name,
                                               sampling=common_pb2.SamplingParams(max_tokens=2))
    return list(stub.Generate(request, timeout=10))


def test_the_least_recently_used_adapter_is_unloaded_for_another(lora_mesh: LoraMesh) -> None:
    worker_id = lora_mesh.ids[1]
    channel, stub = lora_mesh.stub(worker_id)
    with channel:
        for name in ("x1", "x2", "x3"):  # known to this worker only; no request reaches it by the router
            stub.LoadLoraAdapter(worker_pb2.LoadLoraAdapterRequest(
                lora_name=name, lora_path=str(write_stand_in_adapter(lora_mesh.root / name, ADAPTER_BYTES))), timeout=10)
        for i, name in enumerate(("x1", "x2", "x1", "x3")):  # both slots x1, x2; x3 then takes x2's
            assert generate(stub, f"lru-{i}", name)[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        for name in ("x1", "x2", "x3"):
            stub.UnloadLoraAdapter(worker_pb2.UnloadLoraAdapterRequest(lora_name=name), timeout=10)

    def of(metric: str) -> list[float]:
        values = lora_mesh.lora(metric)
        return [values[(worker_id, name)] for name in ("x1", "x2", "x3")]

    assert of("kvmesh_worker_lora_requests_total") == [2, 1, 1]
    assert of("kvmesh_worker_lora_loads_total") == [1, 1, 1]
    # x2 went for x3; x1 and x3 when they were forgotten.
    assert of("kvmesh_worker_lora_unloads_total") == [1, 1, 1]
    assert of("kvmesh_worker_lora_resident") == [0, 0, 0]


def test_an_adapter_loaded_at_run_time_is_served_there_until_it_is_unloaded(lora_mesh: LoraMesh) -> None:
    home, other = lora_mesh.ids
    channel, stub = lora_mesh.stub(home)
    with channel:
        state = stub.LoadLoraAdapter(worker_pb2.LoadLoraAdapterRequest(
            lora_name="late", lora_path=str(write_stand_in_adapter(lora_mesh.root / "late", ADAPTER_BYTES)), load=True),
            timeout=10)
        assert (state.lora_name, state.resident, state.size_bytes) == ("late", True, ADAPTER_BYTES)
        assert wait_until(lambda: "late" in lora_mesh.info(home).lora_adapters, 5)
        assert "late" not in lora_mesh.info(other).lora_adapters
        assert wait_until(lambda: lora_mesh.complete("late", seed=300).status_code == 200, 5)
        for seed in range(301, 304):  # only `home` knows it
            r = lora_mesh.complete("late", seed=seed)
            assert r.headers["x-kvmesh-worker"] == home and "adapter=resident" in chosen(r)
        with pytest.raises(grpc.RpcError) as taken:
            stub.LoadLoraAdapter(worker_pb2.LoadLoraAdapterRequest(
                lora_name="late", lora_path=str(lora_mesh.root / "a")), timeout=10)
        assert taken.value.code() == grpc.StatusCode.ALREADY_EXISTS
        gone = stub.UnloadLoraAdapter(worker_pb2.UnloadLoraAdapterRequest(lora_name="late"), timeout=10)
        assert gone.lora_name == "late" and not gone.resident
        assert wait_until(lambda: "late" not in lora_mesh.info(home).lora_adapters, 5)
    assert lora_mesh.lora("kvmesh_worker_lora_loads_total")[(home, "late")] == 1
    assert lora_mesh.lora("kvmesh_worker_lora_resident")[(home, "late")] == 0
    assert wait_until(lambda: lora_mesh.complete("late", seed=310).status_code == 404, 5)


def test_an_adapter_nobody_serves_is_refused_naming_it(lora_mesh: LoraMesh) -> None:
    r = lora_mesh.complete("no-such-adapter", seed=400)
    assert r.status_code == 404 and "no-such-adapter" in r.text
    # A worker asked directly (a router's stale view) refuses it itself, before its engine sees it.
    channel, stub = lora_mesh.stub(lora_mesh.ids[0])
    with channel, pytest.raises(grpc.RpcError) as refused:
        generate(stub, "unknown-1", "no-such-adapter")
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no-such-adapter" in (refused.value.details() or "")
    assert ("kvmesh-outcome", "OUTCOME_MODEL_NOT_SERVED") in tuple(refused.value.trailing_metadata() or ())


@pytest.mark.parametrize("check", [(), ("--check-config",)], ids=["start", "check-config"])
def test_a_lora_module_that_is_no_adapter_stops_the_worker_with_one_line(etcd: Etcd, tmp_path: Path,
                                                                         check: tuple[str, ...]) -> None:
    proc = service("services.decode_worker", "--etcd-endpoints", etcd.endpoint, "--namespace", "lora-bad",
                   "--engine", "mocker", *check, "--lora-modules", f"broken={tmp_path}", name="bad-worker")
    try:
        code = proc.popen.wait(60)
    finally:
        proc.stop()
    errors = [line for line in proc.lines if line.startswith("error:")]
    assert code == 2, proc.tail()
    assert len(errors) == 1 and "--lora-modules" in errors[0] and "'broken'" in errors[0], proc.tail()
    assert "Traceback" not in "\n".join(proc.lines), proc.tail()
