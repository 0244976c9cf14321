"""A structured-output stream on vLLM whose decode worker dies mid-output: the grammar cannot be
resumed on another worker (vLLM starts a request's grammar at the beginning of its output), so the
stream ends with an error event, and every character the client got still fits the grammar."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from tests.procs import Etcd, ServiceMesh, service
from tests.e2e.test_migration import act_after, stream

pytestmark = pytest.mark.vllm
# At least 300 characters before the model may end it: a few hundred tokens, well past the cut.
PATTERN = "[ab]{300,}"


@pytest.fixture
def vllm_worker_mesh(etcd: Etcd) -> Iterator[ServiceMesh]:
    mesh = ServiceMesh(etcd.endpoint)
    yield mesh
    mesh.stop()


def test_a_structured_stream_whose_worker_dies_ends_with_an_error_never_invalid_text(
        vllm_worker_mesh: ServiceMesh) -> None:
    mesh = vllm_worker_mesh
    worker = service("services.decode_worker", "--etcd-endpoints", mesh.etcd, "--namespace", mesh.namespace,
                     "--engine", "vllm", "--drain-timeout", "8", name="decode-worker")
    mesh.procs.append(worker)
    worker.wait_for(r"decode-worker ready: ", 240)
    broken = stream(mesh, "ab", act_after(5, lambda s: worker.kill()), max_tokens=3000,
                    structured_outputs={"regex": PATTERN})
    assert broken.error is not None and "grammar cannot be resumed" in broken.error, broken.error
    assert broken.finish is None
    text = "".join(broken.text)
    assert text and re.fullmatch("[ab]+", text), text  # a prefix of what the grammar allows
