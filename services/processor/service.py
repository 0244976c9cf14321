"""The processor: prompt -> tokens -> router -> decode worker -> text, streamed back.

Per request it tokenizes (chat template or plain text, or takes token ids), checks the context
length the model is served with (its decode workers', context_limit.py), asks a router for a
worker, streams each of the `n` choices (choice_stream.py: tokens to text, retry and migration
when a worker fails) and reports usage. The choices run concurrently on the worker the router
chose. What each worker's engine found cached of the prompt goes back to the router that chose it
(`Routes.report`), once per routing.

Traced as a `generate` span (under the gateway's) with a `tokenize` child; the router's `route`
and the workers' `decode` spans join it through the calls' metadata. A request that asks to
`explain` gets the router's reasons for the announced worker in its first message.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import assert_never

import grpc
from opentelemetry.trace import Span
from prometheus_client import CollectorRegistry, Counter, Gauge

from gen.kvmesh.v1 import common_pb2, processor_pb2, processor_pb2_grpc
from services.config_error import ConfigError
from services.mesh.grpc_server import abort_with, as_rpc
from services.mesh.hop_latency import HopLatency, hop_latency_histogram
from services.mesh.session_client import SessionPool
from services.mesh.session_kind import PROCESSOR_SESSION, CallError, CallInfo, call_info
from services.mesh.session_server import SessionHub
from services.mesh.recent_failures import RecentFailures
from services.routing.router_client import Admit, Held, NoWorkerError, Overloaded, RouteChoice, Routes, RoutingError
from services.mesh.streams import merge
from services.mesh.tracing import TRACING_OFF, Tracing
from services.mesh.logs import REQUEST_ID
from services.processor.choice_stream import (
    ChoiceContext,
    ChoiceFailure,
    ChoiceLimits,
    ChoiceSpec,
    ChoiceStream,
    Delta,
    Finished,
    RouteFn,
    Started,
)
from services.processor.chat_render import forced_tool_output
from services.processor.context_limit import ContextLimit
from services.processor.output_parsers import OutputParsers
from services.processor.prompt import Prompt
from services.processor.prompt_errors import ContextLengthError, PromptError
from services.processor.prompt_input import tokenized
from services.processor.tokenizer import ModelTokenizer
from services.processor.validation import check_request, context_error

log = logging.getLogger(__name__)

GENERATE_RPC = "kvmesh.v1.Processor/Generate"
# The longest a new request may wait in a router's queue, whatever its own time limit.
MAX_QUEUE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ProcessorConfig:
    served_model_name: str
    request_timeout_s: float = 600.0
    # Workers tried per choice when one fails before its first token.
    max_attempts: int = 3
    # Moves of a choice to another worker after its first token (0 = a mid-stream failure fails it).
    migration_limit: int = 3
    max_inflight: int = 4096
    # max_tokens of a request that sets none.
    default_max_tokens: int = 2048

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ConfigError("--served-model-name is empty")
        if not self.request_timeout_s > 0:
            raise ConfigError(f"--request-timeout must be > 0, got {self.request_timeout_s}")
        if self.default_max_tokens < 1:
            raise ConfigError(f"--default-max-tokens must be >= 1, got {self.default_max_tokens}")
        if self.migration_limit < 0:
            raise ConfigError(f"--migration-limit must be >= 0, got {self.migration_limit}")
        if self.max_attempts < 1 or self.max_inflight < 1:
            raise ConfigError("the processor needs at least one attempt and one in-flight request")


class ProcessorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.migrations = Counter("kvmesh_processor_migrations",
                                  "choices moved to another decode worker after their first token", registry=registry)
        self.handoffs = Counter("kvmesh_processor_handoffs", "choices a draining decode worker handed over (moved "
                                "with their KV where it held any)", registry=registry)
        self.recomputed = Counter("kvmesh_processor_resumed_tokens_recomputed", "tokens decode workers computed "
                                  "again for choices they took mid-stream (migrated, or handed over without usable "
                                  "KV), less what they found cached", registry=registry)
        self.inflight = Gauge("kvmesh_processor_inflight_requests", "requests this processor is serving",
                              registry=registry)
        self.worker_failures = Counter("kvmesh_processor_worker_failures",
                                       "decode worker calls that failed (before or after the first token)",
                                       registry=registry)
        self.hops = hop_latency_histogram(registry)


class ProcessorServicer(processor_pb2_grpc.ProcessorServicer):
    def __init__(self, config: ProcessorConfig, tokenizer: ModelTokenizer, routers: Routes,
                 sessions: SessionPool, metrics: ProcessorMetrics, tracing: Tracing = TRACING_OFF,
                 parsers: OutputParsers | None = None, context: ContextLimit | None = None) -> None:
        """`context`: the context length to enforce, followed from the decode workers
        (context_limit.py); None: the model's config.json alone, as with no worker known."""
        self._config = config
        self._context = context or ContextLimit(config.served_model_name, tokenizer.config_context)
        self._parsers = parsers or OutputParsers(None)
        self._tracing = tracing
        self._tok = tokenizer
        self._routers = routers
        self._sessions = sessions
        # Gateways' sessions: every request they send, served by `generate`.
        self.sessions = SessionHub(PROCESSOR_SESSION, self.generate,
                                   latency=HopLatency(metrics.hops, "processor", upstream=sessions.clock))
        self._metrics = metrics
        self._failed = RecentFailures()
        self._limits = ChoiceLimits(config.request_timeout_s, config.max_attempts, config.migration_limit)
        self.inflight = 0
        metrics.inflight.set_function(lambda: self.inflight)

    async def Generate(  # noqa: N802
        self, request: processor_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[processor_pb2.GenerateResponse]:
        async for msg in as_rpc(context, self.generate(request, call_info(context))):
            yield msg

    async def Session(self, frames: AsyncIterator[processor_pb2.ProcessorSessionDown],  # noqa: N802
                      context: grpc.aio.ServicerContext) -> None:
        await self.sessions.serve(frames, context)

    async def CountTokens(self, request: processor_pb2.GenerateRequest,  # noqa: N802
                          context: grpc.aio.ServicerContext) -> processor_pb2.CountTokensResponse:
        """The request's prompt tokens, rendered and tokenized as `generate` would, not run."""
        REQUEST_ID.set(request.request_id)
        if request.model != self._config.served_model_name:
            await abort_with(context, CallError(common_pb2.OUTCOME_MODEL_NOT_SERVED,
                                                f"model {request.model[:200]!r} is not served here"))
        if self.inflight >= self._config.max_inflight:
            await abort_with(context, CallError(common_pb2.OUTCOME_OVERLOADED, "processor overloaded"))
        self.inflight += 1  # a large prompt's tokenizing (in a thread) is work in flight too
        try:
            check_request(request, self._context.tokens)
            tokens, _ = await self._tokenize(request)
        except PromptError as exc:
            await abort_with(context, _refused(exc))
        finally:
            self.inflight -= 1
        return processor_pb2.CountTokensResponse(input_tokens=len(tokens))

    async def generate(self, request: processor_pb2.GenerateRequest,
                       call: CallInfo) -> AsyncIterator[processor_pb2.GenerateResponse]:
        """Checks, tokenizes and streams one prompt's choices (for `Generate` and a call on a
        session alike).

        Bad input ends the call BAD_REQUEST (a prompt that cannot fit the context:
        CONTEXT_TOO_LONG) with a one-line message, another model MODEL_NOT_SERVED, too much work
        OVERLOADED: outcomes the gateway answers with (services/contract/outcomes.py)."""
        REQUEST_ID.set(request.request_id)  # this call's task: its log lines carry the id
        with self._tracing.server_span("generate", call, GENERATE_RPC) as span:
            async for msg in self._serve(request, span, call):
                yield msg

    async def _serve(self, request: processor_pb2.GenerateRequest, span: Span,
                     call: CallInfo) -> AsyncIterator[processor_pb2.GenerateResponse]:
        rid = request.request_id or uuid.uuid4().hex
        if span.is_recording():
            span.set_attributes({"kvmesh.request_id": rid, "kvmesh.n": max(request.n, 1)})
        try:
            check_request(request, self._context.tokens)
            for resumed in request.resume:
                # Resumed ids go to an engine as they are: the same checks as a prompt's.
                self._tok.check_ids(list(resumed.token_ids))
        except PromptError as exc:
            raise _refused(exc) from None
        if request.model != self._config.served_model_name:
            raise CallError(common_pb2.OUTCOME_MODEL_NOT_SERVED, f"model {request.model[:200]!r} is not served here")
        if self.inflight >= self._config.max_inflight:
            raise CallError(common_pb2.OUTCOME_OVERLOADED, "processor overloaded")
        # Counted from here: a large prompt's tokenizing (in a thread) is work in flight too.
        self.inflight += 1
        try:
            try:
                with self._tracing.span("tokenize") as tokenizing:
                    tokens, media = await self._tokenize(request)
                    if tokenizing.is_recording():
                        tokenizing.set_attributes({"kvmesh.prompt_tokens": len(tokens),
                                                   "kvmesh.prompt_kind": request.WhichOneof("input") or ""})
                sampling = self._checked_sampling(request, len(tokens))
            except PromptError as exc:
                raise _refused(exc) from None
            async for msg in self._generate(rid, request, Prompt(tokens, media), sampling, span, call):
                yield msg
        except ChoiceFailure as exc:
            log.warning("request %s failed (%s): %s", rid, exc.outcome_name, exc.message)
            raise
        finally:
            self.inflight -= 1

    # -- input -------------------------------------------------------------------------------

    async def _tokenize(self, request: processor_pb2.GenerateRequest) -> tuple[list[int], list[common_pb2.MediaItem]]:
        return await tokenized(self._tok, request)

    def _checked_sampling(self, request: processor_pb2.GenerateRequest, prompt_len: int) -> common_pb2.SamplingParams:
        """The sampling to run with, or refused when it does not fit. A request that sets no
        max_tokens gets `default_max_tokens` (or the room left, if less): a generation nobody
        bounded must not pin a worker for minutes. A required or named tool_choice becomes the
        structured output that enforces it."""
        context = self._context.tokens
        if prompt_len >= context:
            raise context_error(prompt_len, context)
        out = common_pb2.SamplingParams()
        out.CopyFrom(request.sampling)
        if request.WhichOneof("input") == "chat":
            forced = forced_tool_output(request.chat)
            if forced is not None:
                out.structured.CopyFrom(forced)
        for param, ids in (("logit_bias", list(out.logit_bias)), ("stop_token_ids", list(out.stop_token_ids))):
            try:
                self._tok.check_ids(ids)
            except PromptError as exc:
                raise PromptError(f"{param}: {exc}", param=param) from None
        room = context - prompt_len
        if not out.max_tokens:
            out.max_tokens = min(room, self._config.default_max_tokens)
        elif out.max_tokens > room:
            raise ContextLengthError(
                f"max_tokens ({out.max_tokens}) plus the prompt ({prompt_len} tokens) exceed this model's "
                f"context length of {context} tokens; at most {room} tokens can be generated"
            )
        if out.min_tokens > out.max_tokens:
            raise PromptError(f"min_tokens ({out.min_tokens}) is larger than max_tokens ({out.max_tokens})")
        return out

    # -- routing and generation --------------------------------------------------------------

    async def _route(self, rid: str, tokens: list[int], tried: list[str], explain: bool = False,
                     lora_name: str = "", session: common_pb2.SessionRef | None = None,
                     media: Sequence[common_pb2.MediaSpan] = ()) -> RouteChoice:
        """A decode worker for the tokens (one that knows `lora_name`, when the request names an
        adapter), never one tried, and one seen failing lately only when no other serves it."""
        try:
            return await self._routers.route(rid, self._config.served_model_name, tokens,
                                             common_pb2.WORKER_ROLE_DECODE, tried, explain=explain,
                                             lora_name=lora_name, session=session, media=media,
                                             avoid=self._failed.current())
        except RoutingError as exc:
            raise _routing_failure(exc) from exc

    def _worker_failed(self, worker_id: str) -> None:
        self._metrics.worker_failures.inc()
        self._failed.add(worker_id)

    async def _generate(self, rid: str, request: processor_pb2.GenerateRequest, prompt: Prompt,
                        sampling: common_pb2.SamplingParams, span: Span,
                        call: CallInfo) -> AsyncIterator[processor_pb2.GenerateResponse]:
        tokens = prompt.tokens
        # Every routing of the request (retries and migrations too) explains itself when asked, so
        # the explanation announced is always that of the worker announced.
        route_fn = partial(self._route, explain=request.explain, lora_name=request.lora_name,
                           session=_session(request), media=prompt.spans())
        n = max(request.n, 1)
        # A takeover from a failed processor runs only the choices the client has not finished.
        resumed = {r.index: list(r.token_ids) for r in request.resume}
        running = [i for i in range(n) if not resumed or request.choice_offset + i in resumed]
        held: Held | None = None
        if resumed:
            # Taken over mid-stream: admitted long ago, and a refusal now would break the stream.
            route = await route_fn(rid, tokens, [])
        else:
            route, held = await self._admit(rid, prompt, request, len(running), sampling.max_tokens)
        try:
            async for msg in self._choices(rid, request, prompt, sampling, span, call, route, route_fn, running,
                                           resumed):
                yield msg
        finally:
            if held is not None:
                held.release()

    async def _admit(self, rid: str, prompt: Prompt, request: processor_pb2.GenerateRequest, streams: int,
                     max_tokens: int) -> tuple[RouteChoice, Held]:
        """A new request's worker through the router's admission (its queue and objectives)."""
        admit = Admit(request.qos, streams, max_tokens, min(self._config.request_timeout_s, MAX_QUEUE_TIMEOUT_S))
        try:
            return await self._routers.admit(rid, self._config.served_model_name, prompt.tokens, admit,
                                             request.explain, lora_name=request.lora_name,
                                             session=_session(request), media=prompt.spans(),
                                             avoid=self._failed.current())
        except Overloaded as exc:
            raise exc.error from None  # the refusal as the router gave it: status, reason, Retry-After
        except RoutingError as exc:
            raise _routing_failure(exc) from exc

    async def _choices(self, rid: str, request: processor_pb2.GenerateRequest, prompt: Prompt,
                       sampling: common_pb2.SamplingParams, span: Span, call: CallInfo, route: RouteChoice,
                       route_fn: RouteFn, running: list[int],
                       resumed: dict[int, list[int]]) -> AsyncIterator[processor_pb2.GenerateResponse]:
        n = max(request.n, 1)
        tokens = prompt.tokens
        # One choice's deltas reach the call's outbox in order by themselves (nothing between
        # them and `call.reply` but this generator chain), so its rows may take the short cut.
        ctx = ChoiceContext(self._tok, self._sessions, self._limits, route_fn, self._worker_failed,
                            self._metrics.migrations.inc, self._parsers.for_request(request),
                            call.reply if len(running) == 1 else None, each_routing_once(self._routers.report),
                            self._metrics.handoffs.inc, self._metrics.recomputed.inc)
        stops = tuple(request.stop)
        choices = [
            ChoiceStream(spec=ChoiceSpec(f"{rid}-{i}" if n > 1 else rid, request.choice_offset + i, tokens,
                                         _choice_sampling(sampling, i), stops, request.lora_name, _session(request),
                                         prompt.media),
                         ctx=ctx).run(route, resumed.get(request.choice_offset + i, []))
            for i in running
        ]
        completion_tokens = 0
        cached_tokens = 0
        announced = False
        async for event in merge(choices):
            match event:
                case Delta(response):
                    yield response
                case Started():
                    if not announced:
                        announced = True
                        if span.is_recording():
                            span.set_attribute("kvmesh.worker_id", event.worker_id)
                        yield processor_pb2.GenerateResponse(route=processor_pb2.RouteInfo(
                            worker_id=event.worker_id, prefill=event.prefill, prompt_tokens=len(tokens),
                            explanation=event.explanation, queue_wait_ms=route.queue_wait_ms))
                case Finished():
                    completion_tokens += event.completion_tokens
                    cached_tokens = max(cached_tokens, event.cached_tokens)
                case _:
                    assert_never(event)
        yield processor_pb2.GenerateResponse(usage=processor_pb2.Usage(
            prompt_tokens=len(tokens), completion_tokens=completion_tokens, cached_tokens=cached_tokens))


def each_routing_once(report: Callable[[RouteChoice, int, int], None]) -> Callable[[RouteChoice, int, int], None]:
    """One request's `on_cached` (choice_stream.py): `report` hears each routing once. The choices
    of a request share its first routing, and the first of them to start stands for all (a later
    one may find the prompt cached by an earlier one, which no routing predicted); a routing is
    its request id and worker, so a choice moved to another worker is a routing of its own."""
    reported: set[tuple[str, str]] = set()

    def on_cached(route: RouteChoice, prompt_tokens: int, cached_tokens: int) -> None:
        key = (route.request_id, route.worker_id)
        if key not in reported:
            reported.add(key)
            report(route, prompt_tokens, cached_tokens)

    return on_cached


def _routing_failure(exc: RoutingError) -> ChoiceFailure:
    if isinstance(exc, NoWorkerError):
        return ChoiceFailure(common_pb2.OUTCOME_NO_WORKER, f"no decode worker can take the request: {exc}")
    return ChoiceFailure(common_pb2.OUTCOME_NO_WORKER, str(exc))


def _session(request: processor_pb2.GenerateRequest) -> common_pb2.SessionRef | None:
    """The agent session the request belongs to (None: none)."""
    return request.session if request.session.id else None


def _refused(exc: PromptError) -> CallError:
    outcome = common_pb2.OUTCOME_CONTEXT_TOO_LONG if isinstance(exc, ContextLengthError) else common_pb2.OUTCOME_BAD_REQUEST
    return CallError(outcome, _one_line(exc), exc.param)


def _one_line(exc: Exception) -> str:
    """gRPC details travel in a header; one line also keeps every log line one event."""
    return " ".join(str(exc).split())


def _choice_sampling(sampling: common_pb2.SamplingParams, index: int) -> common_pb2.SamplingParams:
    """Choice i of a seeded request uses seed+i, so `n` seeded choices differ but stay reproducible."""
    if index == 0 or not sampling.HasField("seed"):
        return sampling
    out = common_pb2.SamplingParams()
    out.CopyFrom(sampling)
    out.seed = sampling.seed + index
    return out
