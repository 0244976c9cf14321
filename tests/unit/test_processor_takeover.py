"""The gateway's stream from processors (services/frontend/processor_stream.py), against scripted
processors behind a real in-process gRPC server (`Processor.Session` through a real SessionHub):
a processor lost before it routed is replaced by another, one lost mid-stream is taken over with
the tokens the client already has (`resume`), at most MAX_PROCESSORS_PER_STREAM are tried, and an
outcome that is the answer becomes the HTTP error at once. Each scripted processor emits token
`BASE + position` per choice, so the client's stream is exact however often it moved."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
import pytest

from gen.kvmesh.v1 import common_pb2, processor_pb2, processor_pb2_grpc
from services.frontend.errors import ApiError
from services.frontend.processor_stream import MAX_PROCESSORS_PER_STREAM, ProcessorStream
from services.mesh.channels import ChannelPool
from services.mesh.recent_failures import RecentFailures
from services.mesh.session_client import Session, SessionPool
from services.mesh.session_kind import PROCESSOR_SESSION, CallError, CallInfo
from services.mesh.session_server import SessionHub
from tests.unit.in_process_grpc import serving

BASE = 500
MAX_TOKENS = 6
MODEL = "m"
GONE = common_pb2.OUTCOME_PEER_GONE


@dataclass(frozen=True)
class Attempt:
    """What one processor does with the stream: route it (or not), emit `tokens` per choice (or
    `tokens[i]` for choice i), then finish with usage, or end with `outcome`. A choice's token at
    the last position carries its finish reason."""

    tokens: int | tuple[int, ...] = MAX_TOKENS
    outcome: int | None = None
    routes: bool = True
    param: str = ""


@dataclass
class ScriptedProcessors(processor_pb2_grpc.ProcessorServicer):
    """Attempt k (request id "q", "q^1", "q^2", ... as the gateway names a takeover, or the k-th
    call for one that never routed) follows `attempts[k]`."""

    attempts: list[Attempt]
    requests: list[processor_pb2.GenerateRequest] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sessions = SessionHub(PROCESSOR_SESSION, self.generate)

    async def Session(self, frames: AsyncIterator[processor_pb2.ProcessorSessionDown],  # noqa: N802
                      context: grpc.aio.ServicerContext) -> None:
        await self.sessions.serve(frames, context)

    async def generate(self, request: processor_pb2.GenerateRequest,
                       call: CallInfo) -> AsyncIterator[processor_pb2.GenerateResponse]:
        self.requests.append(request)
        attempt = self.attempts[len(self.requests) - 1]
        if attempt.routes:
            yield processor_pb2.GenerateResponse(route=processor_pb2.RouteInfo(worker_id="w", prompt_tokens=4))
            resumed = {r.index: len(r.token_ids) for r in request.resume}
            running = [i for i in range(max(request.n, 1)) if not request.resume or i in resumed]
            produced = 0
            per_choice = {i: attempt.tokens[i] if isinstance(attempt.tokens, tuple) else attempt.tokens
                          for i in running}
            for step in range(max(per_choice.values())):
                for i in running:
                    position = resumed.get(i, 0) + step
                    if position >= MAX_TOKENS or step >= per_choice[i]:
                        continue
                    last = position == MAX_TOKENS - 1
                    produced += 1
                    yield processor_pb2.GenerateResponse(delta=processor_pb2.ChoiceDelta(
                        index=i, text=f"<{position}>", token_ids=[BASE + position],
                        finish_reason=common_pb2.FINISH_REASON_LENGTH if last else common_pb2.FINISH_REASON_UNSPECIFIED))
        if attempt.outcome is not None:
            raise CallError(attempt.outcome, f"scripted {common_pb2.Outcome.Name(attempt.outcome)}", attempt.param)
        yield processor_pb2.GenerateResponse(usage=processor_pb2.Usage(prompt_tokens=4, completion_tokens=produced))


@dataclass
class Processors:
    """The gateway's MeshView as ProcessorStream uses it: processors p0, p1, ... in turn, all served
    by one scripted server (the script follows the attempt, not the processor)."""

    address: str
    sessions: SessionPool
    count: int = 6
    chosen: list[str] = field(default_factory=list)

    def processor_for(self, model: str, exclude: Sequence[str] = (),
                      avoid: Sequence[str] = ()) -> tuple[str, Session] | None:
        free = [f"p{i}" for i in range(self.count) if f"p{i}" not in exclude]
        free = [p for p in free if p not in avoid] or free
        if not free:
            return None
        self.chosen.append(free[0])
        return free[0], self.sessions.get(PROCESSOR_SESSION, self.address)


@dataclass
class Outcome:
    route: processor_pb2.RouteInfo | None
    deltas: list[processor_pb2.ChoiceDelta]
    usage: processor_pb2.Usage | None
    error: ApiError | None
    scripted: ScriptedProcessors
    mesh: Processors
    took_over: bool
    failures: list[str]

    def tokens(self, index: int = 0) -> list[int]:
        return [t for d in self.deltas if d.index == index for t in d.token_ids]


async def stream(attempts: list[Attempt], n: int = 1) -> Outcome:
    scripted = ScriptedProcessors(attempts)
    channels = ChannelPool()
    sessions = SessionPool(channels)
    failures = RecentFailures()
    request = processor_pb2.GenerateRequest(request_id="q", model=MODEL, n=n,
                                            sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS))
    route, deltas, usage, error = None, [], None, None
    async with serving(processor_pb2_grpc.add_ProcessorServicer_to_server, scripted) as address:
        mesh = Processors(address, sessions)
        ps = ProcessorStream(mesh, request, 30, failures)  # type: ignore[arg-type]
        try:
            route = await ps.open()
            async for msg in ps.messages():
                assert not isinstance(msg, tuple), "the scripted processors send messages, never rows"
                if msg.WhichOneof("kind") == "delta":
                    deltas.append(msg.delta)
                else:
                    usage = msg.usage
        except ApiError as exc:
            error = exc
        finally:
            await sessions.close()
            await channels.close()
    return Outcome(route, deltas, usage, error, scripted, mesh, ps.took_over, failures.current())


EVERY_TOKEN = [BASE + p for p in range(MAX_TOKENS)]


async def test_a_processor_lost_before_routing_is_replaced_by_another() -> None:
    o = await stream([Attempt(routes=False, outcome=GONE), Attempt()])
    assert o.error is None and o.tokens() == EVERY_TOKEN and not o.took_over
    assert o.mesh.chosen == ["p0", "p1"] and o.failures == ["p0"]
    # Nothing had streamed: the same request, not a takeover.
    assert [r.request_id for r in o.scripted.requests] == ["q", "q"] and not o.scripted.requests[1].resume


@pytest.mark.parametrize("outcome", [GONE, common_pb2.OUTCOME_PEER_DRAINING, common_pb2.OUTCOME_PEER_FAILED],
                         ids=common_pb2.Outcome.Name)
async def test_a_processor_lost_mid_stream_is_taken_over_with_the_tokens_the_client_has(outcome: int) -> None:
    o = await stream([Attempt(tokens=2, outcome=outcome), Attempt()])
    assert o.error is None and o.took_over
    assert o.tokens() == EVERY_TOKEN, "no token twice, none missing"
    takeover = o.scripted.requests[1]
    assert takeover.request_id == "q^1"
    assert [(r.index, list(r.token_ids)) for r in takeover.resume] == [(0, EVERY_TOKEN[:2])]
    # Usage counts every token the client got, not only the last processor's.
    assert o.usage is not None and o.usage.completion_tokens == MAX_TOKENS
    assert o.failures == ["p0"]


async def test_a_takeover_resumes_only_the_choices_not_finished() -> None:
    # Choice 0 finishes on the first processor; it is lost after choice 1's third token.
    o = await stream([Attempt(tokens=(MAX_TOKENS, 3), outcome=GONE), Attempt()], n=2)
    assert o.error is None and o.took_over
    assert o.tokens(0) == EVERY_TOKEN and o.tokens(1) == EVERY_TOKEN
    assert [(r.index, list(r.token_ids)) for r in o.scripted.requests[1].resume] == [(1, EVERY_TOKEN[:3])]
    assert o.usage is not None and o.usage.completion_tokens == 2 * MAX_TOKENS


async def test_a_processor_lost_after_every_choice_finished_costs_only_its_usage_message() -> None:
    o = await stream([Attempt(outcome=GONE), Attempt()], n=2)
    assert o.error is None and len(o.scripted.requests) == 1, "nothing left to take over"
    assert o.tokens(0) == EVERY_TOKEN and o.tokens(1) == EVERY_TOKEN
    assert o.usage is not None and (o.usage.completion_tokens, o.usage.prompt_tokens) == (2 * MAX_TOKENS, 4)


async def test_a_stream_moves_at_most_max_processors_times_then_is_answered() -> None:
    o = await stream([Attempt(tokens=1, outcome=GONE)] * (MAX_PROCESSORS_PER_STREAM + 2))
    assert o.error is not None and o.error.status == 503
    assert len(o.scripted.requests) == MAX_PROCESSORS_PER_STREAM
    assert o.tokens() == EVERY_TOKEN[:MAX_PROCESSORS_PER_STREAM], "each streamed token reached the client once"


@pytest.mark.parametrize("outcome, status, code, param", [
    (common_pb2.OUTCOME_BAD_REQUEST, 400, "invalid_request", "stop"),
    (common_pb2.OUTCOME_MODEL_NOT_SERVED, 404, "model_not_found", None),
    (common_pb2.OUTCOME_OVERLOADED, 429, "overloaded", None),
    (common_pb2.OUTCOME_NO_WORKER, 503, "unavailable", None),
    (common_pb2.OUTCOME_DEADLINE, 503, "timeout", None),
], ids=["BAD_REQUEST", "MODEL_NOT_SERVED", "OVERLOADED", "NO_WORKER", "DEADLINE"])
async def test_an_outcome_that_is_the_answer_is_the_http_error_without_another_processor(
        outcome: int, status: int, code: str, param: str | None) -> None:
    o = await stream([Attempt(routes=False, outcome=outcome, param=param or ""), Attempt()])
    assert o.error is not None and (o.error.status, o.error.code, o.error.param) == (status, code, param)
    assert len(o.scripted.requests) == 1 and o.failures == []


async def test_an_outcome_that_is_the_answer_mid_stream_is_not_taken_over() -> None:
    o = await stream([Attempt(tokens=2, outcome=common_pb2.OUTCOME_NO_WORKER), Attempt()])
    assert o.error is not None and o.error.status == 503 and not o.took_over
    assert len(o.scripted.requests) == 1 and o.tokens() == EVERY_TOKEN[:2]
