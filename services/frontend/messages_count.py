"""`POST /v1/messages/count_tokens`: a Message's prompt tokens, counted by a processor.

The processor renders and tokenizes the request exactly as it would to generate it (chat template,
tools and all) and answers the count (`Processor.CountTokens`): nothing reaches a router or a
worker. The call has a deadline; a processor that fails, is gone or is draining is set aside and
the count asked of the next one (as a generation's stream moves before its first output,
processor_stream.py), up to MAX_PROCESSORS; past that the answer is a 503. What a processor
answers (a prompt past the context, a model it does not serve) is the answer.
"""

from __future__ import annotations

import logging
import time

import grpc

from gen.kvmesh.v1 import common_pb2, processor_pb2, processor_pb2_grpc
from services.contract.outcomes import Action, Hop, verdict
from services.frontend.errors import ApiError, answered
from services.frontend.mesh import MeshView
from services.mesh.channels import ChannelPool
from services.mesh.grpc_server import OUTCOME_KEY, PARAM_KEY
from services.mesh.recent_failures import RecentFailures
from services.mesh.session_kind import CallError
from services.mesh.tracing import outgoing_metadata

log = logging.getLogger(__name__)

# Processors asked per count, counting the first.
MAX_PROCESSORS = 2
# Tokenizing is milliseconds; this bounds a processor that hangs, not one that works.
COUNT_TIMEOUT_S = 30.0

# The outcome of a call that ended without the processor's own (the connection's status).
_OUTCOME_OF_STATUS = {
    grpc.StatusCode.UNAVAILABLE: common_pb2.OUTCOME_PEER_GONE,
    grpc.StatusCode.DEADLINE_EXCEEDED: common_pb2.OUTCOME_DEADLINE,
    grpc.StatusCode.CANCELLED: common_pb2.OUTCOME_CANCELLED,
}


async def count_tokens(mesh: MeshView, channels: ChannelPool, request: processor_pb2.GenerateRequest,
                       failures: RecentFailures, timeout_s: float = COUNT_TIMEOUT_S) -> int:
    """The prompt tokens of `request` (a chat GenerateRequest); ApiError when none can count them."""
    deadline = time.monotonic() + timeout_s
    tried: list[str] = []
    last: CallError | None = None
    while len(tried) < MAX_PROCESSORS:
        chosen = mesh.processor_for(request.model, exclude=tried, avoid=failures.current())
        if chosen is None:
            break
        processor, session = chosen
        tried.append(processor)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ApiError(503, f"counting took longer than {timeout_s:.0f}s", code="timeout")
        stub = processor_pb2_grpc.ProcessorStub(channels.get(session.address))
        try:
            reply = await stub.CountTokens(request, timeout=remaining, metadata=outgoing_metadata())
        except grpc.aio.AioRpcError as exc:
            error = call_error(exc)
            judged = verdict(Hop.PROCESSOR, error.outcome)
            # UNIMPLEMENTED: a processor from before CountTokens (a rolling upgrade) still
            # generates well, so it is only passed over here, not set aside for generation too.
            if judged.set_aside and exc.code() is not grpc.StatusCode.UNIMPLEMENTED:
                failures.add(processor)
            if judged.action is Action.ANSWER:
                raise answered(error) from None
            last = error
            log.warning("request %s: processor %s failed to count tokens (%s); trying another", request.request_id,
                        processor, error.outcome_name)
            continue
        return reply.input_tokens
    if last is not None:
        raise ApiError(503, f"no processor could count the tokens: {last.message or last.outcome_name}",
                       code="unavailable")
    raise ApiError(503, f"no processor serves {request.model[:200]!r} right now", code="unavailable")


def call_error(exc: grpc.aio.AioRpcError) -> CallError:
    """A unary call's failure as the CallError the processor ended it with (grpc_server.abort_with
    puts the outcome and the field at fault in the trailers), else as the connection's status says."""
    trailers = {key: value for key, value in exc.trailing_metadata() or () if isinstance(value, str)}
    outcome = _OUTCOME_OF_STATUS.get(exc.code(), common_pb2.OUTCOME_PEER_FAILED)
    name = trailers.get(OUTCOME_KEY, "")
    if name in common_pb2.Outcome.keys():  # else a newer processor's outcome: judged by the status
        outcome = common_pb2.Outcome.Value(name)
    return CallError(outcome, exc.details() or exc.code().name, param=trailers.get(PARAM_KEY, ""))
