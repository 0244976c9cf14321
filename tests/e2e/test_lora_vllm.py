"""LoRA adapters on real vLLM: the demo model with two random adapters (and a third loaded at run
time), served by the session's disaggregated vLLM mesh (a prefill and a decode worker over NIXL,
tests/conftest.py), and compared with a single plain vLLM (tests/e2e/plain_vllm.py) running the
same adapters.

One reference run serves every test of the module (each vLLM start costs tens of seconds on two
cores). It binds its engine to as many cores as each of the mesh's two engines has
(services/engines/cpu_cores.py), so both compute with the same threads and neither starves the
other.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.processor.tokenizer import ModelTokenizer
from tests.conftest import LORA_A as A
from tests.conftest import LORA_B as B
from tests.e2e.plain_vllm import PlainVllm
from tests.procs import Mesh, registered, wait_until

pytestmark = pytest.mark.vllm
MODEL = "kvmesh-demo"
C = "runtime-lora-c"
MAX_TOKENS = 12


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(20, 1000) for _ in range(n)]


# Each prompt starts differently, so none reuses another's cache.
SHORT = tokens(101, 48)  # prefilled on the decode worker
CACHED = tokens(102, 100)  # three full blocks, prefilled locally
RUNTIME = tokens(103, 40)
LONG = tokens(104, 300)  # prefilled remotely, its KV pulled over NIXL
# The (prompt, adapter) pairs the plain vLLM answers; "" is the base model.
CASES = [(SHORT, ""), (SHORT, A), (SHORT, B), (RUNTIME, C), (LONG, A), (LONG, B)]


class LoraReference:
    """The plain vLLM's answers to CASES. Its token ids are compared, as the mesh's text: the
    text of a stream is what the tokenizer's `decode` gives for its tokens (vLLM's own text
    instead holds back a last incomplete UTF-8 character)."""

    def __init__(self, model: Path, adapters: dict[str, str]) -> None:
        self.run = PlainVllm(model, {"adapters": adapters, "max_tokens": MAX_TOKENS,
                                     "cases": [[p, lora] for p, lora in CASES]})
        self._tokenizer = ModelTokenizer(str(model))

    def output(self, prompt: list[int], lora: str) -> str:
        """The text of the plain vLLM's greedy tokens for `prompt` under adapter `lora`."""
        return self._tokenizer.decode(self.run.outputs()[CASES.index((prompt, lora))]["token_ids"])


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The demo adapters (served from the start) and one more, loaded at run time."""
    from services.tools.make_demo_adapter import AdapterSpec, ensure_demo_adapters, write_demo_adapter
    from services.tools.make_demo_model import ensure_demo_model

    served = dict(module.split("=", 1) for module in ensure_demo_adapters())
    runtime = write_demo_adapter(tmp_path_factory.mktemp("lora") / C, ensure_demo_model(), AdapterSpec(seed=7))
    return {**served, C: str(runtime)}


@pytest.fixture(scope="module")
def plain(adapters: dict[str, str]) -> Iterator[LoraReference]:
    from services.tools.make_demo_model import ensure_demo_model

    reference = LoraReference(ensure_demo_model(), adapters)
    yield reference
    reference.run.stop()


@pytest.fixture(scope="module")
def mesh(vllm_disagg_mesh: Mesh, plain: LoraReference) -> Mesh:
    """The session's 1 prefill + 1 decode vLLM mesh, serving demo-lora-a and demo-lora-b; the
    reference runs beside it from the module's start."""
    return vllm_disagg_mesh


def complete(mesh: Mesh, model: str, prompt: list[int], explain: bool = False) -> httpx.Response:
    headers = {"x-kvmesh-explain": "1"} if explain else None
    return httpx.post(f"{mesh.base_url}/completions", headers=headers, timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})


def text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def cached_tokens(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def router_matches(mesh: Mesh, prompt: list[int], lora: str) -> dict[str, int]:
    """The router's cached-block scores per worker for `prompt` run with adapter `lora`."""
    import grpc

    from gen.kvmesh.v1 import router_pb2, router_pb2_grpc

    (router,) = registered(mesh.etcd, mesh.namespace, "kv-router")
    with grpc.insecure_channel(router.address) as channel:
        reply = router_pb2_grpc.RouterStub(channel).FindMatches(
            router_pb2.FindMatchesRequest(model=MODEL, token_ids=prompt, lora_name=lora), timeout=10)
    return {worker: score for worker, score in reply.scores.items() if score}


def test_the_base_and_each_adapter_answer_differently_and_as_a_plain_vllm_does(mesh: Mesh,
                                                                             plain: LoraReference) -> None:
    answers = {lora: complete(mesh, lora or MODEL, SHORT) for lora in ("", A, B)}
    for lora, r in answers.items():
        assert r.json()["model"] == (lora or MODEL)  # the client's name is echoed
        assert r.headers["x-kvmesh-prefill"] == "local"
        assert text(r) == plain.output(SHORT, lora), lora
    assert len({text(r) for r in answers.values()}) == 3


def test_an_adapter_never_reuses_another_adapters_cache(mesh: Mesh) -> None:
    first = complete(mesh, B, CACHED)
    assert cached_tokens(first) == 0
    decode = first.headers["x-kvmesh-worker"]
    again = complete(mesh, B, CACHED, explain=True)
    assert cached_tokens(again) >= 3 * 32 and text(again) == text(first)
    assert f"lora={B}" in again.headers["x-kvmesh-route"]
    # B's blocks reached the router keyed by B: none of them counts for A or the base model.
    assert wait_until(lambda: router_matches(mesh, CACHED, B) == {decode: 3}, 10), router_matches(mesh, CACHED, B)
    assert router_matches(mesh, CACHED, A) == {} and router_matches(mesh, CACHED, "") == {}
    other = complete(mesh, A, CACHED, explain=True)
    assert cached_tokens(other) == 0, "adapter A was served from adapter B's KV cache"
    assert f"lora={A}" in other.headers["x-kvmesh-route"] and " overlap=0 " in other.headers["x-kvmesh-route"]
    assert cached_tokens(complete(mesh, MODEL, CACHED)) == 0
    assert text(other) != text(first)


def test_an_unknown_adapter_is_a_404_naming_it(mesh: Mesh) -> None:
    r = complete(mesh, "no-such-lora", SHORT)
    assert r.status_code == 404 and "no-such-lora" in r.json()["error"]["message"], r.text


def test_an_adapter_loaded_at_run_time_is_served_and_gone_once_unloaded(mesh: Mesh, adapters: dict[str, str],
                                                                         plain: LoraReference) -> None:
    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{mesh.base_url}/{path}", json=body, timeout=60)

    def models() -> dict[str, str | None]:
        return {m["id"]: m["parent"] for m in httpx.get(f"{mesh.base_url}/models", timeout=10).json()["data"]}

    assert models() == {MODEL: None, A: MODEL, B: MODEL}
    loaded = post("load_lora_adapter", {"lora_name": C, "lora_path": adapters[C]})
    assert loaded.status_code == 200 and C in loaded.text, loaded.text
    assert models()[C] == MODEL
    assert text(complete(mesh, C, RUNTIME)) == plain.output(RUNTIME, C)
    removed = post("unload_lora_adapter", {"lora_name": C})
    assert removed.status_code == 200 and C in removed.text, removed.text
    assert C not in models()
    gone = complete(mesh, C, RUNTIME)
    assert gone.status_code == 404 and C in gone.json()["error"]["message"], gone.text
    again = post("unload_lora_adapter", {"lora_name": C})
    assert again.status_code == 404 and C in again.json()["error"]["message"], again.text


def test_remote_prefill_with_an_adapter_gives_the_aggregated_output(mesh: Mesh, plain: LoraReference) -> None:
    """The prefill worker computes the KV with the request's adapter and the decode worker goes on
    with the same one: exactly what one vLLM gives. B after A is remote as well: A's blocks of
    the same prompt are no cache for B."""
    for lora in (A, B):
        r = complete(mesh, lora, LONG)
        assert r.headers["x-kvmesh-prefill"].startswith("remote:"), (lora, r.headers.get("x-kvmesh-prefill"))
        assert text(r) == plain.output(LONG, lora), lora
