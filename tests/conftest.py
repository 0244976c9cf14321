"""Session-wide real infrastructure: one etcd, one mocker mesh, two vLLM meshes (aggregated, and
disaggregated with LoRA adapters), each started when a test first needs it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from tests.procs import Etcd, Mesh

if TYPE_CHECKING:
    import openai  # imported by the fixtures that use it: a second and a half `make test-unit` need not pay

# The context length the shared mocker and aggregated vLLM meshes serve (their workers'
# --max-model-len; the demo model's own is 131072): the tests of the limit stay small.
MESH_CONTEXT = 4096
# The vLLM meshes' drain: a call still open when a test module ends is cut after this, so their
# teardown fits Mesh.stop's wait (three vLLM children draining one after another).
TEST_DRAIN_S = 8


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The vLLM tests run last: their engines start once, late, and load no other test's clock."""
    items.sort(key=lambda item: item.get_closest_marker("vllm") is not None)


@pytest.fixture(scope="session")
def etcd() -> Iterator[Etcd]:
    server = Etcd.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def mocker_mesh(etcd: Etcd) -> Iterator[Mesh]:
    # speedup 20: the timing model still orders events, but a 16-token answer takes milliseconds.
    mesh = Mesh.launch(etcd.endpoint, "mocker", "mocker", "--speedup", "20", "--decode-workers", "1",
                       "--max-model-len", str(MESH_CONTEXT))
    yield mesh
    assert mesh.stop() == 0, mesh.launcher.tail()


@pytest.fixture(scope="session")
def vllm_stops() -> Iterator[list[Mesh]]:
    """The vLLM meshes, told to stop (SIGTERM) when their fixture ends and waited for here, after
    all of them: their engines shut down side by side instead of one mesh after the other."""
    meshes: list[Mesh] = []
    yield meshes
    codes = {mesh.namespace: mesh.stop() for mesh in meshes}
    assert set(codes.values()) <= {0}, (codes, [mesh.launcher.tail() for mesh in meshes])


@pytest.fixture(scope="session")
def vllm_mesh(etcd: Etcd, vllm_stops: list[Mesh]) -> Iterator[Mesh]:
    # The demo model's chat template writes tool calls in the format of vLLM's `hermes` parser.
    mesh = Mesh.launch(etcd.endpoint, "vllm", "vllm", "--decode-workers", "2", "--drain-timeout", str(TEST_DRAIN_S),
                       "--tool-call-parser", "hermes", "--max-model-len", str(MESH_CONTEXT), timeout_s=400)
    yield mesh
    mesh.launcher.terminate()
    vllm_stops.append(mesh)


@pytest.fixture(scope="session")
def mocker_client(mocker_mesh: Mesh) -> openai.OpenAI:
    import openai

    return openai.OpenAI(base_url=mocker_mesh.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def vllm_client(vllm_mesh: Mesh) -> openai.OpenAI:
    import openai

    return openai.OpenAI(base_url=vllm_mesh.base_url, api_key="unused", max_retries=0, timeout=120)


# The adapters the disaggregated vLLM mesh serves from its start (tests/e2e/test_lora_vllm.py).
LORA_A, LORA_B = "demo-lora-a", "demo-lora-b"
# Prompts of more than this many uncached tokens prefill on the disaggregated mesh's prefill worker.
MAX_LOCAL_PREFILL = 128


@pytest.fixture(scope="session")
def vllm_disagg_mesh(etcd: Etcd, vllm_stops: list[Mesh]) -> Iterator[Mesh]:
    """1 prefill + 1 decode vLLM worker over NIXL, serving the demo LoRA adapters: the
    disaggregated checks (test_disagg_vllm) and the LoRA ones (test_lora_vllm) share its two
    engine starts. Prompts of more than MAX_LOCAL_PREFILL uncached tokens prefill remotely."""
    from services.tools.make_demo_adapter import ensure_demo_adapters

    served = dict(module.split("=", 1) for module in ensure_demo_adapters())
    mesh = Mesh.launch(etcd.endpoint, "vllm-disagg", "vllm", "--prefill-workers", "1", "--decode-workers", "1",
                       "--max-local-prefill-length", str(MAX_LOCAL_PREFILL), "--drain-timeout", str(TEST_DRAIN_S),
                       "--allow-explain", "--allow-runtime-lora",
                       "--lora-modules", f"{LORA_A}={served[LORA_A]}", f"{LORA_B}={served[LORA_B]}", timeout_s=400)
    yield mesh
    mesh.launcher.terminate()
    vllm_stops.append(mesh)
