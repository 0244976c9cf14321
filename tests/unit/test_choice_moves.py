"""A choice's moves between decode workers (services/processor/choice_stream.py), against scripted
workers behind a real in-process gRPC server (`Worker.Session` through a real SessionHub): a
worker lost before the first token is retried elsewhere up to `max_attempts`, one lost after it
is migrated with the tokens so far up to `migration_limit`, and an outcome that is the answer
ends the choice at once. The scripted workers emit token `BASE + position`, so the choice's output
is exact however often it moved."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc
import pytest

from gen.kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.contract.outcomes import Action, Hop, verdict
from services.mesh.channels import ChannelPool
from services.mesh.session_client import SessionPool
from services.mesh.session_kind import WORKER_SESSION, CallError, CallInfo
from services.mesh.session_server import SessionHub
from services.processor.choice_stream import (
    ChoiceContext,
    ChoiceFailure,
    ChoiceLimits,
    ChoiceSpec,
    ChoiceStream,
    Delta,
    Finished,
    Started,
)
from services.processor.tokenizer import ModelTokenizer
from services.routing.router_client import RouteChoice
from services.tools.make_demo_model import ensure_demo_model
from services.worker.kv_pull import kv_pull_from_proto, kv_pull_to_proto
from tests.unit.in_process_grpc import serving

PROMPT = [11, 12, 13, 14]
BASE = 300  # the token a scripted worker generates at output position p is BASE + p
MAX_TOKENS = 8


@dataclass(frozen=True)
class Attempt:
    """What one worker call does: emit `tokens` outputs, then end with `outcome` (None: finish)."""

    tokens: int = MAX_TOKENS
    outcome: int | None = None
    param: str = ""
    # Hands the call over after `tokens` (a draining worker), with this KV ({}: none held).
    handoff: dict | None = None


@dataclass
class ScriptedWorkers(worker_pb2_grpc.WorkerServicer):
    """Attempt k of the choice (request id "r", "r~1", "r~2", ...) follows `attempts[k]`."""

    attempts: list[Attempt]
    requests: list[worker_pb2.WorkerGenerateRequest] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sessions = SessionHub(WORKER_SESSION, self.generate)

    async def Session(self, frames: AsyncIterator[worker_pb2.WorkerSessionDown],  # noqa: N802
                      context: grpc.aio.ServicerContext) -> None:
        await self.sessions.serve(frames, context)

    async def generate(self, request: worker_pb2.WorkerGenerateRequest,
                       call: CallInfo) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        self.requests.append(request)
        attempt = self.attempts[len(self.requests) - 1]
        done = request.resumed_tokens
        left = request.sampling.max_tokens
        for i in range(min(attempt.tokens, left)):
            last = attempt.outcome is None and attempt.handoff is None and i == left - 1
            yield worker_pb2.WorkerGenerateResponse(
                token_ids=[BASE + done + i], cached_tokens=2,
                finish_reason=common_pb2.FINISH_REASON_LENGTH if last else common_pb2.FINISH_REASON_UNSPECIFIED)
        if attempt.handoff is not None:
            reply = worker_pb2.WorkerGenerateResponse()
            if attempt.handoff:
                reply.handoff.CopyFrom(kv_pull_to_proto(attempt.handoff))
            else:
                reply.handoff.SetInParent()
            yield reply
            raise CallError(common_pb2.OUTCOME_PEER_DRAINING, "scripted drain")
        if attempt.outcome is not None:
            raise CallError(attempt.outcome, f"scripted {common_pb2.Outcome.Name(attempt.outcome)}", attempt.param)


@dataclass
class Run:
    events: list[object]
    failure: ChoiceFailure | None
    workers: ScriptedWorkers
    failed: list[str]
    migrations: int
    handoffs: int = 0

    def tokens(self) -> list[int]:
        return [t for e in self.events if isinstance(e, Delta) for t in e.response.delta.token_ids]


@pytest.fixture(scope="module")
def tokenizer() -> Iterator[ModelTokenizer]:
    yield ModelTokenizer(str(ensure_demo_model()))


@asynccontextmanager
async def workers(attempts: list[Attempt]) -> AsyncIterator[tuple[ScriptedWorkers, SessionPool]]:
    scripted = ScriptedWorkers(attempts)
    channels = ChannelPool()
    sessions = SessionPool(channels)
    async with serving(worker_pb2_grpc.add_WorkerServicer_to_server, scripted) as address:
        scripted.address = address  # type: ignore[attr-defined]
        try:
            yield scripted, sessions
        finally:
            await sessions.close()
            await channels.close()


async def run(tokenizer: ModelTokenizer, attempts: list[Attempt], max_attempts: int = 3, migration_limit: int = 3,
              structured: bool = False, lora_name: str = "") -> Run:
    failed: list[str] = []
    migrations = [0]
    handoffs = [0]
    async with workers(attempts) as (scripted, sessions):
        address = scripted.address  # type: ignore[attr-defined]

        async def route(rid: str, tokens: list[int], tried: list[str]) -> RouteChoice:
            return RouteChoice(f"w{len(tried)}", address, 0, 0.0, 0)

        sampling = common_pb2.SamplingParams(max_tokens=MAX_TOKENS)
        if structured:
            sampling.structured.regex = "[0-9]+"
        ctx = ChoiceContext(tokenizer, sessions, ChoiceLimits(30, max_attempts, migration_limit), route, failed.append,
                            lambda: migrations.__setitem__(0, migrations[0] + 1),
                            on_handoff=lambda: handoffs.__setitem__(0, handoffs[0] + 1))
        choice = ChoiceStream(ChoiceSpec("r", 0, PROMPT, sampling, [], lora_name), ctx)
        events: list[object] = []
        failure = None
        try:
            async for event in choice.run(await route("r", PROMPT, [])):
                events.append(event)
        except ChoiceFailure as exc:
            failure = exc
        return Run(events, failure, scripted, failed, migrations[0], handoffs[0])


EVERY_TOKEN = [BASE + p for p in range(MAX_TOKENS)]
GONE, FAILED = common_pb2.OUTCOME_PEER_GONE, common_pb2.OUTCOME_PEER_FAILED


async def test_a_worker_that_answers_streams_the_choice_once_announced(tokenizer: ModelTokenizer) -> None:
    r = await run(tokenizer, [Attempt()])
    assert r.failure is None and r.tokens() == EVERY_TOKEN
    assert [e.worker_id for e in r.events if isinstance(e, Started)] == ["w0"]
    assert isinstance(r.events[-1], Finished) and r.events[-1].completion_tokens == MAX_TOKENS
    assert r.failed == [] and r.migrations == 0


@pytest.mark.parametrize("outcome", [GONE, common_pb2.OUTCOME_PEER_DRAINING, FAILED, common_pb2.OUTCOME_SESSION_FULL],
                         ids=common_pb2.Outcome.Name)
async def test_a_worker_lost_before_the_first_token_is_retried_on_another(tokenizer: ModelTokenizer,
                                                                          outcome: int) -> None:
    r = await run(tokenizer, [Attempt(0, outcome), Attempt()])
    assert r.failure is None and r.tokens() == EVERY_TOKEN
    assert [e.worker_id for e in r.events if isinstance(e, Started)] == ["w1"]
    # A busy worker (its session full) is not set aside; a lost one is.
    assert r.failed == ([] if outcome == common_pb2.OUTCOME_SESSION_FULL else ["w0"]) and r.migrations == 0
    retry = r.workers.requests[1]
    # The same request, under a fresh engine id: the first worker may still hold the old one.
    assert (retry.request_id, list(retry.token_ids), retry.resumed_tokens) == ("r~1", PROMPT, 0)


async def test_retries_stop_at_max_attempts_with_no_worker(tokenizer: ModelTokenizer) -> None:
    r = await run(tokenizer, [Attempt(0, GONE)] * 5, max_attempts=3)
    assert r.failure is not None and r.failure.outcome == common_pb2.OUTCOME_NO_WORKER
    assert "after 3 attempts" in r.failure.message
    assert r.failed == ["w0", "w1", "w2"] and len(r.workers.requests) == 3


async def test_a_worker_lost_mid_stream_moves_the_choice_with_its_tokens(tokenizer: ModelTokenizer) -> None:
    r = await run(tokenizer, [Attempt(3, FAILED), Attempt(2, GONE), Attempt()])
    assert r.failure is None
    assert r.tokens() == EVERY_TOKEN, "no token twice, none missing"
    assert r.migrations == 2 and r.failed == ["w0", "w1"]
    assert [e.worker_id for e in r.events if isinstance(e, Started)] == ["w0"], "announced once"
    second, third = r.workers.requests[1], r.workers.requests[2]
    assert (list(second.token_ids), second.resumed_tokens, second.sampling.max_tokens) == (
        PROMPT + EVERY_TOKEN[:3], 3, MAX_TOKENS - 3)
    assert (list(third.token_ids), third.resumed_tokens, third.sampling.max_tokens) == (
        PROMPT + EVERY_TOKEN[:5], 5, MAX_TOKENS - 5)
    assert isinstance(r.events[-1], Finished) and r.events[-1].completion_tokens == MAX_TOKENS


async def test_a_choice_runs_with_its_lora_adapter_on_every_worker_it_moves_to(tokenizer: ModelTokenizer) -> None:
    r = await run(tokenizer, [Attempt(0, GONE), Attempt(3, FAILED), Attempt()], lora_name="alpha")
    assert r.failure is None and r.tokens() == EVERY_TOKEN
    assert [req.lora_name for req in r.workers.requests] == ["alpha"] * 3
    plain = await run(tokenizer, [Attempt()])
    assert plain.workers.requests[0].lora_name == ""


async def test_migrations_stop_at_the_limit_with_no_worker(tokenizer: ModelTokenizer) -> None:
    r = await run(tokenizer, [Attempt(1, GONE)] * 4, migration_limit=2)
    assert r.failure is not None and r.failure.outcome == common_pb2.OUTCOME_NO_WORKER
    assert "already moved 2 times" in r.failure.message
    assert r.migrations == 2 and len(r.workers.requests) == 3
    assert r.tokens() == EVERY_TOKEN[:3], "what streamed before the failure stays streamed"


async def test_a_structured_output_choice_is_not_migrated(tokenizer: ModelTokenizer) -> None:
    # The next worker's grammar would start over: an error, never invalid output.
    r = await run(tokenizer, [Attempt(2, GONE), Attempt()], structured=True)
    assert r.failure is not None and r.failure.outcome == common_pb2.OUTCOME_NO_WORKER
    assert "structured-output" in r.failure.message and len(r.workers.requests) == 1 and r.migrations == 0


@pytest.mark.parametrize("outcome, param", [
    (common_pb2.OUTCOME_BAD_REQUEST, "logit_bias"),
    (common_pb2.OUTCOME_CONTEXT_TOO_LONG, ""),
    (common_pb2.OUTCOME_READ_TOO_SLOWLY, ""),
], ids=lambda x: common_pb2.Outcome.Name(x) if isinstance(x, int) else x)
async def test_an_outcome_that_is_the_answer_ends_the_choice_where_it_is(tokenizer: ModelTokenizer, outcome: int,
                                                                         param: str) -> None:
    r = await run(tokenizer, [Attempt(0, outcome, param), Attempt()])
    assert r.failure is not None and (r.failure.outcome, r.failure.param) == (outcome, param)
    assert len(r.workers.requests) == 1 and r.failed == [] and r.migrations == 0


@pytest.mark.parametrize("streamed", [0, 2], ids=["before-output", "mid-stream"])
@pytest.mark.parametrize("outcome", [o for o in common_pb2.Outcome.values() if o != common_pb2.OUTCOME_OK],
                         ids=common_pb2.Outcome.Name)
async def test_whatever_the_workers_end_with_the_processor_answers_with_an_outcome_its_gateway_keeps(
        tokenizer: ModelTokenizer, outcome: int, streamed: int) -> None:
    # Every worker fails the same way: past the moves, the choice fails; the gateway must take
    # that failure as the answer, never move the stream to another processor for a worker's fault.
    r = await run(tokenizer, [Attempt(streamed, outcome)] * 8, max_attempts=2, migration_limit=1)
    assert r.failure is not None
    assert verdict(Hop.PROCESSOR, r.failure.outcome).action is Action.ANSWER, r.failure.outcome_name


async def test_a_worker_past_the_deadline_ends_the_choice_as_a_timeout(tokenizer: ModelTokenizer) -> None:
    r = await run(tokenizer, [Attempt(0, common_pb2.OUTCOME_DEADLINE), Attempt()])
    assert r.failure is not None and r.failure.outcome == common_pb2.OUTCOME_DEADLINE
    assert "took longer than 30s" in r.failure.message and len(r.workers.requests) == 1


HELD = {"agent": "w0", "request_id": "r", "nbytes": 4096, "checksum": 2**63 + 5}


async def test_a_handed_over_choice_moves_with_its_kv_counting_no_failure(tokenizer: ModelTokenizer) -> None:
    r = await run(tokenizer, [Attempt(3, handoff=HELD), Attempt(2, handoff={}), Attempt()], migration_limit=0)
    assert r.failure is None and r.tokens() == EVERY_TOKEN
    # Nothing failed: no worker set aside, no migration counted (the limit of 0 would have refused one).
    assert r.failed == [] and r.migrations == 0 and r.handoffs == 2
    assert [e.worker_id for e in r.events if isinstance(e, Started)] == ["w0"], "announced once"
    second, third = r.workers.requests[1], r.workers.requests[2]
    assert (list(second.token_ids), second.resumed_tokens, second.moved_from) == (PROMPT + EVERY_TOKEN[:3], 3, "w0")
    assert kv_pull_from_proto(second.moved_kv) == HELD, "the handoff's KV, exact (a 64-bit checksum)"
    # Handed over without KV: the next worker is told where it came from, and computes it.
    assert (third.resumed_tokens, third.moved_from, third.HasField("moved_kv")) == (5, "w1", False)


async def test_a_structured_choice_handed_over_mid_stream_ends_rather_than_restart_its_grammar(
        tokenizer: ModelTokenizer) -> None:
    r = await run(tokenizer, [Attempt(3, handoff=HELD), Attempt()], structured=True)
    assert r.failure is not None and r.failure.outcome == common_pb2.OUTCOME_NO_WORKER
    assert "structured-output" in r.failure.message and r.handoffs == 0
