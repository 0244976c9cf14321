"""A decode worker refuses, with OUTCOME_BAD_REQUEST and one line, a request no engine could serve."""

from __future__ import annotations

import pytest

from gen.kvmesh.v1 import common_pb2, worker_pb2
from services.mesh.session_kind import CallError
from services.worker.servicer import request_from_proto


CASES = [
    ("empty prompt", worker_pb2.WorkerGenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=4)),
     "the prompt is empty"),
    ("no tokens to generate", worker_pb2.WorkerGenerateRequest(token_ids=[1, 2]), "max_tokens must be at least 1"),
    ("min above max", worker_pb2.WorkerGenerateRequest(
        token_ids=[1], sampling=common_pb2.SamplingParams(max_tokens=2, min_tokens=3)), "min_tokens (3) exceeds"),
    ("everything resumed", worker_pb2.WorkerGenerateRequest(
        token_ids=[1, 2], resumed_tokens=2, sampling=common_pb2.SamplingParams(max_tokens=2)),
     "resumed_tokens (2) must be fewer"),
]


@pytest.mark.parametrize(("case", "request_", "message"), CASES, ids=[c[0] for c in CASES])
async def test_an_unservable_request_is_a_bad_request(case: str, request_: worker_pb2.WorkerGenerateRequest,
                                                         message: str) -> None:
    with pytest.raises(CallError, match=message.replace("(", r"\(").replace(")", r"\)")) as refused:
        request_from_proto(request_)
    assert refused.value.outcome == common_pb2.OUTCOME_BAD_REQUEST


async def test_a_resumed_request_keeps_its_resumed_tokens() -> None:
    request = worker_pb2.WorkerGenerateRequest(request_id="r~1", token_ids=[5, 6, 7, 8], resumed_tokens=2,
                                               sampling=common_pb2.SamplingParams(max_tokens=3, seed=9))
    engine_request = request_from_proto(request)
    assert engine_request.token_ids == [5, 6, 7, 8] and engine_request.resumed_tokens == 2
    assert engine_request.sampling.max_tokens == 3 and engine_request.sampling.seed == 9
