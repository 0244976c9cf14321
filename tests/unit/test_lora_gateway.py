"""The gateway's side of LoRA adapters: what a request's `model` names, `/v1/models`, and the
load and unload endpoints against real gRPC workers (in-process servers answering as worker.proto
says a worker answers)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import cast

import grpc
import httpx
import pytest

from gen.kvmesh.v1 import worker_pb2, worker_pb2_grpc
from services.frontend.app import create_app
from services.frontend.config import FrontendConfig
from services.frontend.endpoints import processor_requests
from services.frontend.lora_admin import LoraAdmin, LoraOutcome, WorkerAnswer, WorkerReply, load_outcome
from services.frontend.mesh import MeshView, ModelTarget
from services.frontend.metrics import FrontendMetrics
from services.frontend.schemas import CompletionRequest, parse
from services.mesh.channels import ChannelPool
from services.mesh.discovery import DECODE_WORKER, PREFILL_WORKER, PROCESSOR, ROUTER, ComponentView, InstanceInfo
from services.mesh.etcd_store import KeyValueStore
from services.mesh.session_client import SessionPool
from tests.unit.in_process_grpc import serving

BASE = "kvmesh-demo"
KEY = "sekrit"


def view(component: str, *infos: InstanceInfo) -> ComponentView:
    """A component's view with these members (no etcd: the test sets what a watch would)."""
    out = ComponentView(cast(KeyValueStore, None), "ns", component)
    out.instances = {i.instance_id: i for i in infos}
    return out


def worker(instance_id: str, model: str = BASE, adapters: tuple[str, ...] = (), address: str = "",
           component: str = DECODE_WORKER) -> InstanceInfo:
    return InstanceInfo(component=component, instance_id=instance_id, address=address, model=model,
                        lora_adapters=adapters)


def mesh_of(*decoders: InstanceInfo, prefills: tuple[InstanceInfo, ...] = (), models: tuple[str, ...] = (BASE,)
            ) -> MeshView:
    processors = [InstanceInfo(component=PROCESSOR, instance_id=f"p-{m}", model=m) for m in models]
    return MeshView(processors=view(PROCESSOR, *processors), routers=view(ROUTER), decoders=view(DECODE_WORKER, *decoders),
                    sessions=SessionPool(ChannelPool()), prefills=view(PREFILL_WORKER, *prefills))


# -- what `model` names -------------------------------------------------------------------------

def test_a_model_names_a_base_model_or_an_adapter_a_decode_worker_lists() -> None:
    mesh = mesh_of(worker("w1", adapters=("alpha",)), worker("w2", adapters=("alpha", "beta")), worker("w3"))
    assert mesh.resolve(BASE) == ModelTarget(BASE)
    assert mesh.resolve("alpha") == ModelTarget(BASE, "alpha")
    assert mesh.resolve("beta") == ModelTarget(BASE, "beta")
    assert mesh.resolve("gamma") is None


def test_a_base_model_wins_over_an_adapter_of_the_same_name_and_two_bases_resolve_alike() -> None:
    mesh = mesh_of(worker("w1", model="zeta", adapters=(BASE, "shared")), worker("w2", adapters=("shared",)),
                   models=(BASE, "zeta"))
    assert mesh.resolve(BASE) == ModelTarget(BASE)
    # Listed by workers of both bases: the first base by name, whichever worker joined first.
    assert mesh.resolve("shared") == ModelTarget(BASE, "shared")


def test_an_adapter_only_a_prefill_worker_lists_names_nothing() -> None:
    # A request runs on a decode worker: one that knows the adapter is what makes it servable.
    mesh = mesh_of(worker("w1"), prefills=(worker("p1", adapters=("alpha",), component=PREFILL_WORKER),))
    assert mesh.resolve("alpha") is None


def test_the_processor_gets_the_base_model_and_the_adapter_and_the_client_model_stays() -> None:
    req = parse(CompletionRequest, {"model": "alpha", "prompt": ["one", "two"], "max_tokens": 2})
    msgs = processor_requests("r1", req, ModelTarget(BASE, "alpha"))
    assert [(m.model, m.lora_name) for m in msgs] == [(BASE, "alpha"), (BASE, "alpha")]
    assert req.model == "alpha"  # what the answer echoes
    [plain] = processor_requests("r2", parse(CompletionRequest, {"model": BASE, "prompt": "x"}))
    assert (plain.model, plain.lora_name) == (BASE, "")


# -- the HTTP surface ---------------------------------------------------------------------------

@asynccontextmanager
async def gateway(mesh: MeshView, admin: LoraAdmin | None = None, keys: tuple[str, ...] = ()
                  ) -> AsyncIterator[httpx.AsyncClient]:
    admin = admin or LoraAdmin(mesh, ChannelPool(), view_wait_s=0.1)
    app = create_app(FrontendConfig(api_keys=keys, allow_runtime_lora=True), mesh, FrontendMetrics(), admin,
                     ChannelPool())
    headers = {"authorization": f"Bearer {KEY}"} if keys else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", headers=headers) as c:
        yield c


async def test_models_lists_the_base_model_then_each_adapter_with_its_parent() -> None:
    # Each card says the context length its (base) model is served with: the smallest its decode
    # workers publish (services/contract/served_context.py).
    mesh = mesh_of(replace(worker("w1", adapters=("beta", "alpha")), extra={"max_model_len": 8192}),
                   replace(worker("w2", adapters=("alpha",)), extra={"max_model_len": 4096}),
                   worker("w3", model="orphan", adapters=("lost",)))
    admin = LoraAdmin(mesh, ChannelPool())
    admin.paths["alpha"] = "/adapters/alpha"
    async with gateway(mesh, admin) as client:
        body = (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    assert body["data"] == [
        {"id": BASE, "object": "model", "created": 0, "owned_by": "kvmesh", "root": BASE, "parent": None,
         "max_model_len": 4096},
        {"id": "alpha", "object": "model", "created": 0, "owned_by": "kvmesh", "root": "/adapters/alpha",
         "parent": BASE, "max_model_len": 4096},
        # Loaded by another gateway (or at the worker's start): its path is not in the records.
        {"id": "beta", "object": "model", "created": 0, "owned_by": "kvmesh", "root": None, "parent": BASE,
         "max_model_len": 4096},
    ]  # `lost` adapts a model no processor serves: not listed, as its base is not


async def test_an_unknown_model_or_adapter_is_a_404_naming_it() -> None:
    async with gateway(mesh_of(worker("w1", adapters=("alpha",)))) as client:
        reply = await client.post("/v1/completions", json={"model": "gamma", "prompt": "hi", "max_tokens": 1})
    assert reply.status_code == 404
    assert reply.json()["error"] == {"message": "the model 'gamma' does not exist", "type": "not_found_error",
                                     "param": "model", "code": "model_not_found"}


async def test_the_lora_endpoints_and_the_model_list_need_the_api_key() -> None:
    async with gateway(mesh_of(worker("w1")), keys=(KEY,)) as client:
        for method, path, body in (("POST", "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"}),
                                   ("POST", "/v1/unload_lora_adapter", {"lora_name": "a"}),
                                   ("GET", "/v1/models", None)):
            reply = await client.request(method, path, json=body, headers={"authorization": "Bearer wrong"})
            assert reply.status_code == 401, path
            assert reply.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(("path", "body", "message", "param"), [
    ("/v1/load_lora_adapter", {}, "missing required fields: lora_name, lora_path", "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": "a"}, "missing required field: lora_path", "lora_path"),
    ("/v1/unload_lora_adapter", {"lora_path": "/x"}, "missing required field: lora_name", "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": "a\nb", "lora_path": "/x"},
     "invalid field lora_name: Value error, must be printable text (no control characters or line breaks)",
     "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": BASE, "lora_path": "/x"},
     f"lora_name '{BASE}' is the name of a base model", "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/x", "base_model_name": "other"},
     "the model 'other' does not exist", "base_model_name"),
    ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/x", "load_inplace": True},
     "load_inplace is not supported: unload the adapter first", "load_inplace"),
])
async def test_a_bad_admin_request_is_refused_naming_its_field(path: str, body: dict, message: str, param: str
                                                              ) -> None:
    async with gateway(mesh_of(worker("w1"))) as client:
        reply = await client.post(path, json=body)
    assert reply.status_code in (400, 404)
    assert (reply.json()["error"]["message"], reply.json()["error"]["param"]) == (message, param)


# -- loading and unloading on workers -----------------------------------------------------------

@dataclass
class ScriptedWorker(worker_pb2_grpc.WorkerServicer):
    """A worker's LoRA RPCs as worker.proto states them; an accepted change is written into the
    gateway's view of its record, as the worker's etcd record would be."""

    pool: ComponentView
    instance_id: str
    lora: bool = True
    refuse: grpc.StatusCode | None = None  # refuses every load with this status
    stuck: bool = False  # never answers a load: the caller's deadline ends the call
    stuck_loads: int = 0
    known: dict[str, str] = field(default_factory=dict)
    unloads: list[str] = field(default_factory=list)

    async def LoadLoraAdapter(self, request: worker_pb2.LoadLoraAdapterRequest,  # noqa: N802
                              context: grpc.aio.ServicerContext) -> worker_pb2.LoraAdapterState:
        if self.stuck:
            self.stuck_loads += 1
            await asyncio.Event().wait()  # cancelled when the call's deadline passes
        if not self.lora:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker was started without LoRA")
        if self.refuse is not None:
            await context.abort(self.refuse, f"adapter {request.lora_name!r}: no adapter_config.json in "
                                             f"{request.lora_path}")
        self.known[request.lora_name] = request.lora_path
        self._publish()
        return worker_pb2.LoraAdapterState(lora_name=request.lora_name, lora_path=request.lora_path)

    async def UnloadLoraAdapter(self, request: worker_pb2.UnloadLoraAdapterRequest,  # noqa: N802
                                context: grpc.aio.ServicerContext) -> worker_pb2.LoraAdapterState:
        if not self.lora:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker was started without LoRA")
        if request.lora_name not in self.known:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"the LoRA adapter {request.lora_name!r} is not known")
        self.unloads.append(request.lora_name)
        path = self.known.pop(request.lora_name)
        self._publish()
        return worker_pb2.LoraAdapterState(lora_name=request.lora_name, lora_path=path)

    def _publish(self) -> None:
        info = self.pool.instances[self.instance_id]
        self.pool.instances[self.instance_id] = replace(info, lora_adapters=tuple(self.known))


@asynccontextmanager
async def workers(mesh: MeshView, *scripts: ScriptedWorker) -> AsyncIterator[None]:
    """Serves each script as its worker, at the address its record gives."""
    async with AsyncExitStack() as stack:
        for script in scripts:
            address = await stack.enter_async_context(serving(worker_pb2_grpc.add_WorkerServicer_to_server, script))
            script.pool.instances[script.instance_id] = replace(script.pool.instances[script.instance_id],
                                                                address=address)
        yield


def two_pools() -> tuple[MeshView, ScriptedWorker, ScriptedWorker, ScriptedWorker]:
    mesh = mesh_of(worker("lora"), worker("plain"), prefills=(worker("prefill", component=PREFILL_WORKER),))
    assert mesh.prefills is not None
    return (mesh, ScriptedWorker(mesh.decoders, "lora"), ScriptedWorker(mesh.decoders, "plain", lora=False),
            ScriptedWorker(mesh.prefills, "prefill"))


async def test_a_load_reaches_every_lora_worker_of_both_pools_and_a_request_right_after_finds_it() -> None:
    mesh, lora, plain, prefill = two_pools()
    async with workers(mesh, lora, plain, prefill), gateway(mesh) as client:
        reply = await client.post("/v1/load_lora_adapter", json={"lora_name": "alpha", "lora_path": "/a/alpha"})
        assert (reply.status_code, reply.text) == (200, "Success: LoRA adapter 'alpha' added successfully.")
        assert reply.headers["content-type"].startswith("text/plain")
        assert lora.known == {"alpha": "/a/alpha"} and prefill.known == {"alpha": "/a/alpha"}
        assert mesh.resolve("alpha") == ModelTarget(BASE, "alpha")
        models = (await client.get("/v1/models")).json()["data"]
        assert {"id": "alpha", "root": "/a/alpha", "parent": BASE}.items() <= models[1].items()

        reply = await client.post("/v1/unload_lora_adapter", json={"lora_name": "alpha"})
        assert (reply.status_code, reply.text) == (200, "Success: LoRA adapter 'alpha' removed successfully.")
        assert lora.known == {} and prefill.known == {} and mesh.resolve("alpha") is None
        assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == [BASE]

        reply = await client.post("/v1/unload_lora_adapter", json={"lora_name": "alpha"})
        assert reply.status_code == 404
        assert reply.json()["error"] == {"message": "the LoRA adapter 'alpha' does not exist",
                                         "type": "not_found_error", "param": "lora_name", "code": "unknown_adapter"}


async def test_a_load_no_worker_serves_lora_for_is_a_400_saying_how_to_start_them() -> None:
    mesh = mesh_of(worker("plain"))
    plain = ScriptedWorker(mesh.decoders, "plain", lora=False)
    async with workers(mesh, plain), gateway(mesh) as client:
        reply = await client.post("/v1/load_lora_adapter", json={"lora_name": "alpha", "lora_path": "/a/alpha"})
    assert reply.status_code == 400
    assert reply.json()["error"] == {
        "message": "no worker serves LoRA adapters (start workers with --enable-lora)",
        "type": "invalid_request_error", "param": None, "code": "lora_disabled"}


async def test_an_adapter_one_worker_refuses_is_a_400_with_its_words_and_the_others_let_go_of_it() -> None:
    mesh = mesh_of(worker("good"), worker("bad"))
    good = ScriptedWorker(mesh.decoders, "good")
    bad = ScriptedWorker(mesh.decoders, "bad", refuse=grpc.StatusCode.INVALID_ARGUMENT)
    async with workers(mesh, good, bad), gateway(mesh) as client:
        reply = await client.post("/v1/load_lora_adapter", json={"lora_name": "alpha", "lora_path": "/nowhere"})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["message"] == "worker bad: adapter 'alpha': no adapter_config.json in /nowhere"
    assert (error["param"], error["code"]) == ("lora_path", "invalid_adapter")
    assert good.unloads == ["alpha"] and good.known == {}
    assert mesh.resolve("alpha") is None


async def test_a_name_taken_by_another_path_is_a_400_and_the_worker_that_had_it_keeps_it() -> None:
    mesh = mesh_of(worker("had", adapters=("alpha",)), worker("taken"))
    had = ScriptedWorker(mesh.decoders, "had", known={"alpha": "/a/one"}, refuse=grpc.StatusCode.ALREADY_EXISTS)
    fresh = ScriptedWorker(mesh.decoders, "taken")
    async with workers(mesh, had, fresh), gateway(mesh) as client:
        reply = await client.post("/v1/load_lora_adapter", json={"lora_name": "alpha", "lora_path": "/a/two"})
    assert reply.status_code == 400
    assert (reply.json()["error"]["param"], reply.json()["error"]["code"]) == ("lora_name", "adapter_conflict")
    assert had.known == {"alpha": "/a/one"} and had.unloads == []
    assert fresh.known == {}  # took the other path for a moment, and let go of it


async def test_a_worker_past_its_deadline_does_not_hold_the_load_up() -> None:
    mesh = mesh_of(worker("quick"), worker("stuck"))
    quick, stuck = ScriptedWorker(mesh.decoders, "quick"), ScriptedWorker(mesh.decoders, "stuck", stuck=True)
    async with workers(mesh, quick, stuck):
        admin = LoraAdmin(mesh, ChannelPool(), call_timeout_s=0.3, view_wait_s=0.5)
        # Waiting for the stuck worker would never end: the generous deadline is only for a failure.
        result = await asyncio.wait_for(admin.load(ModelTarget(BASE, "alpha"), "/a/alpha"), 30)
    assert result.outcome is LoraOutcome.LOADED and result.holders == ("quick",)
    assert stuck.stuck_loads == 1 and stuck.known == {} and quick.known == {"alpha": "/a/alpha"}


def reply_of(answer: WorkerAnswer, component: str = DECODE_WORKER) -> WorkerReply:
    return WorkerReply(worker(answer.value, component=component), answer, f"{answer.value} words")


@pytest.mark.parametrize(("answers", "outcome"), [
    ([WorkerAnswer.ACCEPTED, WorkerAnswer.LORA_OFF, WorkerAnswer.UNREACHABLE], LoraOutcome.LOADED),
    ([WorkerAnswer.ACCEPTED, WorkerAnswer.INVALID], LoraOutcome.INVALID),
    ([WorkerAnswer.CONFLICT, WorkerAnswer.ACCEPTED], LoraOutcome.CONFLICT),
    ([WorkerAnswer.LORA_OFF, WorkerAnswer.UNREACHABLE], LoraOutcome.UNREACHABLE),
    ([WorkerAnswer.LORA_OFF, WorkerAnswer.LORA_OFF], LoraOutcome.LORA_OFF),
    ([], LoraOutcome.LORA_OFF),
])
def test_a_loads_outcome_over_the_workers_answers(answers: list[WorkerAnswer], outcome: LoraOutcome) -> None:
    assert load_outcome("alpha", [reply_of(a) for a in answers]).outcome is outcome


def test_a_load_only_prefill_workers_took_serves_no_request() -> None:
    replies = [reply_of(WorkerAnswer.ACCEPTED, PREFILL_WORKER), reply_of(WorkerAnswer.LORA_OFF)]
    assert load_outcome("alpha", replies).outcome is LoraOutcome.LORA_OFF


async def test_run_time_loading_is_a_403_naming_the_flag_unless_the_gateway_allows_it() -> None:
    mesh = mesh_of(worker("w1", adapters=("alpha",)))
    channels = ChannelPool()
    app = create_app(FrontendConfig(), mesh, FrontendMetrics(), LoraAdmin(mesh, channels), channels)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        for path, body in (("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"}),
                           ("/v1/unload_lora_adapter", {"lora_name": "alpha"})):
            reply = await client.post(path, json=body)
            assert reply.status_code == 403
            assert reply.json()["error"]["code"] == "runtime_lora_disabled"
            assert "--allow-runtime-lora" in reply.json()["error"]["message"]
