"""Session-wide real infrastructure: one etcd, one mocker mesh, one vLLM mesh (started lazily)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from tests.procs import Etcd, Mesh

if TYPE_CHECKING:
    import openai  # imported by the fixtures that use it: a second and a half `make test-unit` need not pay

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
    mesh = Mesh.launch(etcd.endpoint, "mocker", "mocker", "--speedup", "20", "--decode-workers", "1")
    yield mesh
    assert mesh.stop() == 0, mesh.launcher.tail()


@pytest.fixture(scope="session")
def vllm_mesh(etcd: Etcd) -> Iterator[Mesh]:
    # The demo model's chat template writes tool calls in the format of vLLM's `hermes` parser.
    mesh = Mesh.launch(etcd.endpoint, "vllm", "vllm", "--decode-workers", "2", "--drain-timeout", str(TEST_DRAIN_S),
                       "--tool-call-parser", "hermes", timeout_s=400)
    yield mesh
    assert mesh.stop() == 0, mesh.launcher.tail()


@pytest.fixture(scope="session")
def mocker_client(mocker_mesh: Mesh) -> openai.OpenAI:
    import openai

    return openai.OpenAI(base_url=mocker_mesh.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def vllm_client(vllm_mesh: Mesh) -> openai.OpenAI:
    import openai

    return openai.OpenAI(base_url=vllm_mesh.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def vllm_disagg_mesh(etcd: Etcd) -> Iterator[Mesh]:
    """1 prefill + 1 decode vLLM worker; prompts of more than 128 uncached tokens prefill remotely.

    Module-scoped: vLLM engines with the NIXL connector keep about half a core busy while idle,
    which would slow every test after them."""
    mesh = Mesh.launch(etcd.endpoint, "vllm-disagg", "vllm", "--prefill-workers", "1", "--decode-workers", "1",
                       "--max-local-prefill-length", "128", "--drain-timeout", str(TEST_DRAIN_S), timeout_s=400)
    yield mesh
    assert mesh.stop() == 0, mesh.launcher.tail()
