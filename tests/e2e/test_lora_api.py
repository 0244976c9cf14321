"""LoRA adapters through the gateway's API, on real processes with the mocker engine: the model
list, requests that name an adapter, and loading and unloading at run time.

The mesh: a decode worker started with adapter `alpha` (`--lora-modules`), a decode worker
without LoRA, and a prefill worker with LoRA on (a load reaches both pools). The adapters are
directories in PEFT's layout (`adapter_config.json` and a weights file); the mocker reads the
config and the weights' size, not the weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from services.mesh.discovery import DECODE_WORKER, PREFILL_WORKER
from services.tools.make_demo_adapter import write_stand_in_adapter
from tests.procs import MODEL, Etcd, ServiceMesh, registered, wait_until

NIXL = ("--kv-transfer", "nixl", "--kv-bytes-per-token", "2048")
PROMPT = "Tell me about prefix caching."


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {name: write_stand_in_adapter(root / name, 64 * 1024, base_model=MODEL) for name in ("alpha", "gamma", "other-alpha")}


@pytest.fixture(scope="module")
def lora_mesh(etcd: Etcd, adapters: dict[str, Path]) -> Iterator[tuple[ServiceMesh, str, str]]:
    """The mesh, the id of the decode worker that serves LoRA and of the one that does not."""
    with ServiceMesh(etcd.endpoint, frontend_flags=("--allow-runtime-lora",)) as mesh:
        _, (lora_worker,) = mesh.worker("--enable-lora", "--max-loras", "2", "--lora-modules",
                                        f"alpha={adapters['alpha']}")
        _, (plain_worker,) = mesh.worker()
        mesh.prefill_worker(*NIXL, "--enable-lora")
        assert wait_until(lambda: "alpha" in model_ids(mesh), 30), model_ids(mesh)
        yield mesh, lora_worker, plain_worker


@pytest.fixture(scope="module")
def client(lora_mesh: tuple[ServiceMesh, str, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=lora_mesh[0].url("/v1"), api_key="unused", max_retries=0, timeout=60)


def model_ids(mesh: ServiceMesh) -> list[str]:
    return [m["id"] for m in httpx.get(mesh.url("/v1/models"), timeout=10).json()["data"]]


def post(mesh: ServiceMesh, path: str, body: dict) -> httpx.Response:
    return httpx.post(mesh.url(path), json=body, timeout=30)


def complete(mesh: ServiceMesh, model: str, prompt: str = PROMPT, max_tokens: int = 6) -> httpx.Response:
    return post(mesh, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens, "seed": 1})


def test_models_lists_the_base_model_and_each_adapter_with_its_parent(lora_mesh: tuple[ServiceMesh, str, str],
                                                                      client: openai.OpenAI) -> None:
    mesh, _, _ = lora_mesh
    cards = httpx.get(mesh.url("/v1/models"), timeout=10).json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [(MODEL, None), ("alpha", MODEL)]
    assert set(cards[0]) == set(cards[1])  # one shape for both
    assert [m.id for m in client.models.list().data] == [MODEL, "alpha"]


def test_a_request_for_an_adapter_runs_on_a_worker_that_knows_it_and_answers_with_its_name(
        lora_mesh: tuple[ServiceMesh, str, str], client: openai.OpenAI) -> None:
    mesh, lora_worker, _ = lora_mesh
    for i in range(4):  # two decode workers: the one without the adapter must never be chosen
        reply = complete(mesh, "alpha", f"{i} {PROMPT}")
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == "alpha"
        assert reply.headers["x-kvmesh-worker"] == lora_worker
    chat = client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": PROMPT}], max_tokens=4)
    assert chat.model == "alpha" and chat.choices[0].message.content
    chunks = list(client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": PROMPT}],
                                                 max_tokens=4, stream=True))
    assert chunks and all(c.model == "alpha" for c in chunks)
    response = client.responses.create(model="alpha", input=PROMPT, max_output_tokens=4)
    assert response.model == "alpha" and response.output_text


def test_an_adapters_tokens_differ_from_the_base_models_and_repeat(lora_mesh: tuple[ServiceMesh, str, str]) -> None:
    mesh, _, _ = lora_mesh
    base = complete(mesh, MODEL, max_tokens=12).json()["choices"][0]["text"]
    adapted = complete(mesh, "alpha", max_tokens=12).json()["choices"][0]["text"]
    assert adapted != base
    assert complete(mesh, "alpha", max_tokens=12).json()["choices"][0]["text"] == adapted


def test_an_unknown_adapter_is_a_404_naming_it(lora_mesh: tuple[ServiceMesh, str, str]) -> None:
    mesh, _, _ = lora_mesh
    reply = complete(mesh, "no-such-adapter")
    assert reply.status_code == 404
    assert reply.json()["error"]["message"] == "the model 'no-such-adapter' does not exist"
    assert reply.json()["error"]["param"] == "model"


def test_an_adapter_loaded_at_run_time_serves_at_once_and_is_gone_once_unloaded(
        lora_mesh: tuple[ServiceMesh, str, str], adapters: dict[str, Path]) -> None:
    mesh, lora_worker, plain_worker = lora_mesh
    reply = post(mesh, "/v1/load_lora_adapter", {"lora_name": "gamma", "lora_path": str(adapters["gamma"])})
    assert (reply.status_code, reply.text) == (200, "Success: LoRA adapter 'gamma' added successfully.")
    # Right after the answer: the gateway waited until the workers' records showed it.
    served = complete(mesh, "gamma")
    assert served.status_code == 200, served.text
    assert served.json()["model"] == "gamma" and served.headers["x-kvmesh-worker"] == lora_worker
    cards = {c["id"]: c for c in httpx.get(mesh.url("/v1/models"), timeout=10).json()["data"]}
    assert (cards["gamma"]["parent"], cards["gamma"]["root"]) == (MODEL, str(adapters["gamma"]))
    decoders = {i.instance_id: i.lora_adapters for i in registered(mesh.etcd, mesh.namespace, DECODE_WORKER)}
    assert "gamma" in decoders[lora_worker] and decoders[plain_worker] == ()
    (prefill,) = registered(mesh.etcd, mesh.namespace, PREFILL_WORKER)
    assert "gamma" in prefill.lora_adapters  # a load reaches the prefill pool too

    reply = post(mesh, "/v1/unload_lora_adapter", {"lora_name": "gamma"})
    assert (reply.status_code, reply.text) == (200, "Success: LoRA adapter 'gamma' removed successfully.")
    gone = complete(mesh, "gamma")
    assert gone.status_code == 404 and gone.json()["error"]["message"] == "the model 'gamma' does not exist"
    assert "gamma" not in model_ids(mesh)
    (prefill,) = registered(mesh.etcd, mesh.namespace, PREFILL_WORKER)
    assert "gamma" not in prefill.lora_adapters
    again = post(mesh, "/v1/unload_lora_adapter", {"lora_name": "gamma"})
    assert again.status_code == 404
    assert (again.json()["error"]["param"], again.json()["error"]["code"]) == ("lora_name", "unknown_adapter")


def test_a_path_that_is_no_adapter_is_a_400_and_loads_nothing(lora_mesh: tuple[ServiceMesh, str, str],
                                                              tmp_path: Path) -> None:
    mesh, _, _ = lora_mesh
    for path in (tmp_path / "missing", tmp_path):  # no directory; a directory without adapter_config.json
        reply = post(mesh, "/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": str(path)})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert (error["param"], error["code"]) == ("lora_path", "invalid_adapter")
        assert "adapter_config.json" in error["message"]
    assert "broken" not in model_ids(mesh)
    assert complete(mesh, "broken").status_code == 404


def test_a_name_loaded_from_another_path_is_a_400_and_the_adapter_stays(lora_mesh: tuple[ServiceMesh, str, str],
                                                                      adapters: dict[str, Path]) -> None:
    mesh, _, _ = lora_mesh
    reply = post(mesh, "/v1/load_lora_adapter", {"lora_name": "alpha", "lora_path": str(adapters["other-alpha"])})
    assert reply.status_code == 400, reply.text
    assert (reply.json()["error"]["param"], reply.json()["error"]["code"]) == ("lora_name", "adapter_conflict")
    # The same path again is no conflict: loading is idempotent.
    same = post(mesh, "/v1/load_lora_adapter", {"lora_name": "alpha", "lora_path": str(adapters["alpha"])})
    assert same.status_code == 200, same.text
    assert complete(mesh, "alpha").status_code == 200


def test_missing_fields_are_a_400_naming_them(lora_mesh: tuple[ServiceMesh, str, str]) -> None:
    mesh, _, _ = lora_mesh
    reply = post(mesh, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == "missing required field: lora_path"
    reply = post(mesh, "/v1/unload_lora_adapter", {})
    assert (reply.status_code, reply.json()["error"]["param"]) == (400, "lora_name")


def test_a_load_where_no_worker_serves_lora_is_a_400_saying_how_to_start_one(etcd: Etcd,
                                                                            adapters: dict[str, Path]) -> None:
    with ServiceMesh(etcd.endpoint, frontend_flags=("--allow-runtime-lora",)) as mesh:
        mesh.worker()
        assert wait_until(lambda: model_ids(mesh) == [MODEL], 30)
        reply = post(mesh, "/v1/load_lora_adapter", {"lora_name": "gamma", "lora_path": str(adapters["gamma"])})
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["message"] == "no worker serves LoRA adapters (start workers with --enable-lora)"
        assert complete(mesh, "gamma").status_code == 404


def test_a_worker_that_starts_after_a_run_time_load_serves_the_adapter_until_it_is_unloaded(
        etcd: Etcd, adapters: dict[str, Path]) -> None:
    with ServiceMesh(etcd.endpoint, frontend_flags=("--allow-runtime-lora",)) as mesh:
        mesh.worker("--enable-lora")
        assert wait_until(lambda: model_ids(mesh) == [MODEL], 30)
        reply = post(mesh, "/v1/load_lora_adapter", {"lora_name": "gamma", "lora_path": str(adapters["gamma"])})
        assert reply.status_code == 200, reply.text
        _, (late,) = mesh.worker("--enable-lora")
        listed = {i.instance_id: i.lora_adapters for i in registered(mesh.etcd, mesh.namespace, DECODE_WORKER)}
        assert listed[late] == ("gamma",)  # learned from etcd at start, not from --lora-modules

        reply = post(mesh, "/v1/unload_lora_adapter", {"lora_name": "gamma"})
        assert reply.status_code == 200, reply.text
        _, (later,) = mesh.worker("--enable-lora")
        listed = {i.instance_id: i.lora_adapters for i in registered(mesh.etcd, mesh.namespace, DECODE_WORKER)}
        assert listed[later] == () and "gamma" not in listed[late]
        assert complete(mesh, "gamma").status_code == 404
