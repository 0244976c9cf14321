"""A decode worker refuses, with INVALID_ARGUMENT and one line, a request no engine could serve."""

from __future__ import annotations

import grpc
import pytest

from gen.kvmesh.v1 import common_pb2, worker_pb2
from services.worker.servicer import request_from_proto


class Aborted(Exception):
    pass


class Context:
    """Stands in for grpc.aio's servicer context: `abort` raises, as it does there."""

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        raise Aborted(details)


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
async def test_an_unservable_request_is_invalid_argument(case: str, request_: worker_pb2.WorkerGenerateRequest,
                                                         message: str) -> None:
    context = Context()
    with pytest.raises(Aborted, match=message.replace("(", r"\(").replace(")", r"\)")):
        await request_from_proto(request_, context)  # type: ignore[arg-type]
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_resumed_request_keeps_its_resumed_tokens() -> None:
    request = worker_pb2.WorkerGenerateRequest(request_id="r~1", token_ids=[5, 6, 7, 8], resumed_tokens=2,
                                               sampling=common_pb2.SamplingParams(max_tokens=3, seed=9))
    engine_request = await request_from_proto(request, Context())  # type: ignore[arg-type]
    assert engine_request.token_ids == [5, 6, 7, 8] and engine_request.resumed_tokens == 2
    assert engine_request.sampling.max_tokens == 3 and engine_request.sampling.seed == 9
