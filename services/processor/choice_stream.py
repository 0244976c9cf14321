"""One choice of a request, streamed from decode workers: tokens to text, and migration.

A choice keeps its state — tokens generated so far, the detokenizer, the stop strings — outside
any one worker call, so when its worker fails it can move:

- before the first token: the same request goes to another worker (a retry);
- after it (the worker died, its stream broke, it aborted the request while draining): the
  prompt *plus every token already generated* goes to another worker, with `resumed_tokens`
  saying how many of those were generated, `max_tokens` and `min_tokens` reduced by them, and
  the same seed and stop strings (a migration). Engines continue the sequence where it broke:
  the mocker's tokens are a function of prompt, sampling and position; vLLM's greedy decoding
  is a function of the context. The client sees one stream, no token twice, none missing, and
  usage counts each token once.

Which worker failures move the choice and which are its answer is the outcome table's
(services/contract/outcomes.py, hop WORKER). At most `max_attempts` workers are tried before the
first token (a choice resumed from another processor counts as before its first token here) and
`migration_limit` migrations are made after it; past them the choice fails with NO_WORKER (never
an outcome the gateway would move to another processor). Each worker the table sets aside is
reported to `on_worker_failed` so routing avoids it at once.

Each worker call's first output says what the engine found cached of the prompt it was sent: it
goes to `on_cached` with the routing that chose the worker (the router's index accuracy), except
where a prefill worker computed the prompt (the decode engine's count then includes what it
pulled, which no routing of the decode pool predicts).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

from gen.kvmesh.v1 import common_pb2, processor_pb2, worker_pb2
from services.contract.outcomes import Action, Hop, verdict
from services.routing.router_client import RouteChoice
from services.mesh.session_client import SessionPool
from services.mesh.session_kind import WORKER_SESSION, CallError, TextRow
from services.mesh.tracing import outgoing_metadata
from services.processor.detokenizer import Detokenizer, StopStrings
from services.processor.output_parsers import OutputParser, ParserFactory
from services.processor.tokenizer import ModelTokenizer

log = logging.getLogger(__name__)

NO_WORKER = common_pb2.OUTCOME_NO_WORKER
FinishReason: TypeAlias = common_pb2.FinishReason
UNFINISHED, STOP, LENGTH = common_pb2.FINISH_REASON_UNSPECIFIED, common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH


class ChoiceFailure(CallError):
    """The choice cannot be completed: the outcome the processor answers its caller with."""


class _WorkerLost(Exception):
    """The worker stopped serving this choice with an outcome the table moves it on from, or
    handed it over (a drain: `handoff` says where it holds the choice's KV)."""

    def __init__(self, message: str, set_aside: bool = True, handoff: worker_pb2.KvPull | None = None) -> None:
        super().__init__(message)
        self.set_aside = set_aside
        self.handoff = handoff


@dataclass(slots=True)
class Started:
    """The choice's first token is on its way: where it runs."""

    worker_id: str
    prefill: common_pb2.PrefillLocation
    # The router's explanation of this worker, when the request asked for one.
    explanation: common_pb2.RouteExplanation | None = None


@dataclass(frozen=True, slots=True)
class Delta:
    """One delta of the choice, in the GenerateResponse that carries it to the gateway as it is."""

    response: processor_pb2.GenerateResponse


@dataclass(slots=True)
class Finished:
    completion_tokens: int
    cached_tokens: int


# What a choice streams: `Started` once, its deltas, then `Finished`.
ChoiceEvent: TypeAlias = Started | Delta | Finished


@dataclass(frozen=True)
class ChoiceLimits:
    request_timeout_s: float
    max_attempts: int
    migration_limit: int


# Routes a choice: (request id, tokens, workers tried) to a worker.
RouteFn = Callable[[str, list[int], list[str]], Awaitable[RouteChoice]]


@dataclass(frozen=True)
class ChoiceSpec:
    """What one choice generates: its id and index, the prompt, its sampling and stop strings,
    and the LoRA adapter and agent session it is generated with."""

    rid: str
    index: int
    prompt: list[int]
    sampling: common_pb2.SamplingParams
    stops: Sequence[str]
    # The LoRA adapter it runs with ("" for the base model): every worker it moves to gets it too.
    lora_name: str = ""
    # The agent session it belongs to (None: none); each worker it runs on is told how long to
    # keep the session's blocks, as the routing that chose that worker said.
    session: common_pb2.SessionRef | None = None
    # The prompt's images (prompt.py): every worker it runs on gets them.
    media: Sequence[common_pb2.MediaItem] = ()


@dataclass(frozen=True)
class ChoiceContext:
    """What every choice of a request shares: the processor's tokenizer, worker sessions, limits,
    routing, and where it reports failed workers and migrations."""

    tokenizer: ModelTokenizer
    sessions: SessionPool
    limits: ChoiceLimits
    route: RouteFn
    on_worker_failed: Callable[[str], None]
    on_migration: Callable[[], None]
    # Reads the text as content, reasoning and tool calls; None: it is all content.
    parsers: ParserFactory | None = None
    # The gateway call's outbox (CallInfo.reply) where the request's one choice may put its
    # rows itself; None where its deltas must go through `run`'s events (several choices, or a
    # per-request RPC).
    reply: Callable[[TextRow], None] | None = None
    # Hears, per worker call, (its routing, prompt tokens sent, the engine's cached_tokens).
    on_cached: Callable[[RouteChoice, int, int], None] | None = None
    # Hears each choice a draining worker handed over (moved with its KV where it held any).
    on_handoff: Callable[[], None] | None = None
    # Hears the tokens a worker computed again for a choice it took mid-stream (a migration, or a
    # handoff without usable KV): prompt and output so far, less what it found cached.
    on_recomputed: Callable[[int], None] | None = None


@dataclass
class ChoiceStream:
    """One choice's state across every worker it runs on; `run` streams its events."""

    spec: ChoiceSpec
    ctx: ChoiceContext
    generated: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    tried: list[str] = field(default_factory=list)
    # One deadline for the whole choice, however often it moves.
    deadline: float = 0.0

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + self.ctx.limits.request_timeout_s
        self._parser: OutputParser | None = None
        # The handoff of the worker that last gave the choice up (its id, where it holds the KV),
        # for the next worker call only.
        self._handoff: tuple[str, worker_pb2.KvPull] | None = None

    async def run(self, first_route: RouteChoice, resumed: Sequence[int] = ()) -> AsyncIterator[ChoiceEvent]:
        """The choice's events: `Started` once, its deltas (each a `Delta` wrapping the
        GenerateResponse that carries it), then `Finished`.

        `resumed`: tokens the client already received from a processor that failed. They go
        through the detokenizer and stop strings unseen (that text was sent already), then the
        choice continues after them as after a migration."""
        spec, ctx = self.spec, self.ctx
        detok = ctx.tokenizer.detokenizer(spec.prompt)
        stopper = StopStrings(list(spec.stops))
        self._parser = ctx.parsers(spec.rid, spec.index) if ctx.parsers is not None else None
        if resumed:
            if spec.sampling.HasField("structured") and len(resumed) < spec.sampling.max_tokens:
                raise ChoiceFailure(NO_WORKER, "a structured-output choice cannot be taken over "
                                    "mid-stream: its grammar cannot be resumed after the tokens already sent")
            self.generated = list(resumed)
            seen, _ = stopper.push(detok.push(list(resumed)))
            if self._parser is not None:
                self._parser.push(seen, resumed)  # the client has what this yields already
            if len(self.generated) >= spec.sampling.max_tokens:
                # Every token was out already; only the last delta never arrived.
                yield Started(first_route.worker_id, common_pb2.PrefillLocation(), first_route.explanation)
                tail, _ = stopper.push(detok.flush())
                response = processor_pb2.GenerateResponse(delta=processor_pb2.ChoiceDelta(index=spec.index))
                if self._parser is None:
                    response.delta.text, response.delta.finish_reason = tail + stopper.flush(), LENGTH
                else:
                    self._fill(response.delta, tail + stopper.flush(), [], LENGTH)
                yield Delta(response)
                yield Finished(len(self.generated), 0)
                return
        route: RouteChoice | None = first_route
        retries = migrations = 0
        announced = False
        while True:
            if route is None:
                route = await ctx.route(spec.rid, spec.prompt + self.generated, self.tried)
            self.tried.append(route.worker_id)
            try:
                async for item in self._from_worker(route, detok, stopper):
                    if isinstance(item, Started):
                        if announced:
                            continue
                        announced = True
                    yield item
                yield Finished(len(self.generated), self.cached_tokens)
                return
            except _WorkerLost as exc:
                if exc.handoff is not None and self._handed_over(route.worker_id, exc.handoff):
                    route = None
                    continue
                if exc.set_aside:
                    ctx.on_worker_failed(route.worker_id)
                if not announced:
                    retries += 1
                    if retries >= ctx.limits.max_attempts:
                        raise ChoiceFailure(NO_WORKER,
                                            f"no worker could serve the request after {retries} attempts: {exc}") from exc
                    log.warning("request %s: worker %s failed before its first token (%s); trying another",
                                spec.rid, route.worker_id, exc)
                else:
                    migrations += 1
                    if spec.sampling.HasField("structured"):
                        # The next worker's grammar would start at the beginning of the output,
                        # not after the tokens the client has: an error, never invalid output.
                        raise ChoiceFailure(NO_WORKER,
                                            f"worker {route.worker_id} failed mid-stream ({exc}); a structured-output "
                                            f"choice cannot continue on another worker (its grammar cannot be "
                                            f"resumed there)") from exc
                    if migrations > ctx.limits.migration_limit:
                        raise ChoiceFailure(NO_WORKER,
                                            f"worker {route.worker_id} failed mid-stream ({exc}) and the request "
                                            f"was already moved {migrations - 1} times") from exc
                    ctx.on_migration()
                    log.warning("request %s: worker %s failed after %d tokens (%s); moving it to another worker",
                                spec.rid, route.worker_id, len(self.generated), exc)
                route = None

    def _handed_over(self, worker_id: str, handoff: worker_pb2.KvPull) -> bool:
        """A draining worker handed the choice over: it goes to another worker at once, with the
        KV where one is held (no retry or migration counted: nothing failed). Not a structured
        choice past its first token: the grammar would restart there (a migration's refusal)."""
        if self.generated and self.spec.sampling.HasField("structured"):
            return False
        self._handoff = (worker_id, handoff)
        if self.ctx.on_handoff is not None:
            self.ctx.on_handoff()
        log.info("request %s: worker %s handed it over after %d tokens (%s); moving it", self.spec.rid, worker_id,
                 len(self.generated), "with its KV" if handoff.HasField("params") else "without KV")
        return True

    def _request(self, route: RouteChoice) -> worker_pb2.WorkerGenerateRequest:
        spec = self.spec
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(spec.sampling)
        done = len(self.generated)
        if done:
            sampling.max_tokens = spec.sampling.max_tokens - done
            sampling.min_tokens = max(0, spec.sampling.min_tokens - done)
        # A moved request gets a fresh engine id: the old worker may still hold the old one.
        rid = spec.rid if len(self.tried) == 1 else f"{spec.rid}~{len(self.tried) - 1}"
        session = None
        if spec.session is not None:
            session = common_pb2.SessionRef(id=spec.session.id, parent_id=spec.session.parent_id,
                                            retain_ms=route.session_retain_ms)
        request = worker_pb2.WorkerGenerateRequest(request_id=rid, token_ids=spec.prompt + self.generated,
                                                   sampling=sampling, prefix_hit_rate=route.prefix_hit_rate,
                                                   resumed_tokens=done, lora_name=spec.lora_name, session=session,
                                                   media=spec.media)
        if self._handoff is not None:
            request.moved_from, handoff = self._handoff
            self._handoff = None
            if handoff.HasField("params"):
                request.moved_kv.CopyFrom(handoff)
        return request

    async def _from_worker(self, route: RouteChoice, detok: Detokenizer,
                           stopper: StopStrings) -> AsyncIterator[ChoiceEvent]:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise self._timed_out()
        prompt_tokens = len(self.spec.prompt) + len(self.generated)
        # The worker's span joins the request's trace (the processor's span is current here).
        stream = self.ctx.sessions.get(WORKER_SESSION, route.address).open(self._request(route), remaining,
                                                                       outgoing_metadata())
        want_logprobs = self.spec.sampling.HasField("logprobs")
        # The fast lane: a choice whose text needs nothing but detokenizing turns the worker's
        # rows into text rows for the gateway where the worker's frame is read (`_row_sink`),
        # with no wake-up of this generator per token. Messages (the first and last outputs,
        # failures) still come here.
        fast = (self.ctx.reply is not None and self._parser is None and not stopper.active
                and not want_logprobs)
        first = True
        try:
            async for msg in stream:
                if type(msg) is list:
                    # A token row: output tokens and nothing else, never a call's first or last.
                    response = self._delta(msg, UNFINISHED, (), detok, stopper, want_logprobs)
                else:
                    if msg.HasField("handoff"):
                        raise _WorkerLost(f"worker {route.worker_id} handed the request over", False, msg.handoff)
                    if first:
                        first = False
                        if not self.generated:
                            self.cached_tokens = msg.cached_tokens
                        elif self.ctx.on_recomputed is not None and msg.prefill.site != common_pb2.PrefillLocation.SITE_REMOTE:
                            self.ctx.on_recomputed(max(0, prompt_tokens - msg.cached_tokens))
                        on_cached = self.ctx.on_cached
                        if on_cached is not None and msg.prefill.site != common_pb2.PrefillLocation.SITE_REMOTE:
                            on_cached(route, prompt_tokens, msg.cached_tokens)
                        yield Started(route.worker_id, msg.prefill, route.explanation)
                        if fast:
                            stream.sink = self._row_sink(detok)
                    response = self._delta(list(msg.token_ids), msg.finish_reason, msg.logprobs, detok, stopper,
                                           want_logprobs)
                if response is not None:
                    yield Delta(response)
                    if response.delta.finish_reason:
                        return
            raise _WorkerLost(f"worker {route.worker_id} ended the stream before the choice finished")
        except CallError as exc:
            # Whether the choice had started does not change which outcomes move it (only how).
            judged = verdict(Hop.WORKER, exc.outcome)
            if judged.action is not Action.ANSWER:
                raise _WorkerLost(f"{exc.outcome_name} {exc.message}", judged.set_aside) from exc
            if exc.outcome == common_pb2.OUTCOME_DEADLINE:
                raise self._timed_out() from exc
            raise ChoiceFailure(exc.outcome, exc.message, exc.param, exc.retry_after_ms, exc.overload) from exc
        finally:
            stream.cancel()

    def _timed_out(self) -> ChoiceFailure:
        return ChoiceFailure(common_pb2.OUTCOME_DEADLINE,
                             f"the request took longer than {self.ctx.limits.request_timeout_s:.0f}s")

    def _row_sink(self, detok: Detokenizer) -> Callable[[list[int]], bool]:
        """Takes a worker's token row while `_from_worker` waits with every delta before it
        delivered (session_client.SessionStream._push_row): the text row goes straight to the
        gateway call's outbox, after them. A row with no text yet (a character still forming)
        goes too: the gateway keeps every token it was sent, for a takeover."""
        generated, push, reply, index = self.generated, detok.push, self.ctx.reply, self.spec.index
        assert reply is not None

        def sink(ids: list[int]) -> bool:
            generated.extend(ids)
            reply((index, push(ids), ids))
            return True

        return sink

    def _delta(self, ids: list[int], finish_reason: FinishReason, logprobs: Sequence[common_pb2.TokenLogprob],
               detok: Detokenizer, stopper: StopStrings, want_logprobs: bool) -> processor_pb2.GenerateResponse | None:
        """The delta of one worker reply (its tokens, finish reason and logprobs), as the response
        that carries it (built in place: a copy per token into a wrapper costs on every stream);
        None when it carries nothing. A delta with tokens but no text yet (a character split
        across tokens) still goes out: the gateway keeps every token it was sent, to hand the
        stream to another processor should this one fail."""
        self.generated.extend(ids)
        text = detok.push(ids) if ids else ""
        if finish_reason:
            text += detok.flush()
        out, stopped = stopper.push(text)
        finish = STOP if stopped else UNFINISHED
        if finish_reason and not stopped:
            out += stopper.flush()
            finish = finish_reason
        if not (ids or out or finish or want_logprobs):
            return None
        response = processor_pb2.GenerateResponse()
        delta = response.delta
        delta.index = self.spec.index
        if self._parser is None:
            delta.text = out
            delta.finish_reason = finish
        else:
            self._fill(delta, out, ids, finish)
        if stopped and delta.finish_reason == STOP:  # not a tool call the parser found before it
            delta.stop_sequence = stopper.matched
        delta.token_ids.extend(ids)
        if want_logprobs:
            tokenizer = self.ctx.tokenizer
            delta.logprobs.extend(logprobs)
            for lp in delta.logprobs:
                for top in lp.top:
                    top.text = tokenizer.token_text(top.token_id)
            delta.token_texts.extend(tokenizer.token_text(t) for t in ids)
        return response

    def _fill(self, delta: processor_pb2.ChoiceDelta, text: str, ids: list[int], finish: FinishReason) -> None:
        """The delta's content, reasoning and tool calls as the choice's parser reads `text`;
        on the last delta, what the parser still held, and TOOL_CALLS for a choice that
        called tools and stopped by itself."""
        parser = self._parser
        assert parser is not None
        parsed = parser.push(text, ids)
        if finish:
            rest = parser.finish()
            parsed.content += rest.content
            parsed.reasoning += rest.reasoning
            parsed.calls += rest.calls
            if finish == STOP and parser.called:
                finish = common_pb2.FINISH_REASON_TOOL_CALLS
        delta.text = parsed.content
        delta.reasoning = parsed.reasoning
        delta.tool_calls.extend(parsed.calls)
        delta.finish_reason = finish
