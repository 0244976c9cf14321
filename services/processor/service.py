"""The processor: prompt -> tokens -> router -> decode worker -> text, streamed back.

Per request it tokenizes (chat template or plain text, or takes token ids), checks the context
length, asks a router for a worker, streams the worker's tokens through an incremental
detokenizer and the stop strings, and reports usage. `n` choices run concurrently on the worker
the router chose. A worker that fails before its first token is replaced by another.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from gen.kvmesh.v1 import common_pb2, processor_pb2, processor_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.mesh.channels import ChannelPool
from services.mesh.flags import ConfigError
from services.mesh.router_client import NoWorkerError, RouteChoice, RouterClient, RoutingError
from services.mesh.streams import merge
from services.processor.detokenizer import IncrementalDetokenizer, StopStrings
from services.processor.tokenizer import ChatTurn, ModelTokenizer, PromptError

log = logging.getLogger(__name__)

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclass(frozen=True)
class ProcessorConfig:
    served_model_name: str
    request_timeout_s: float = 600.0
    # Workers tried per choice when one fails before its first token.
    max_attempts: int = 3
    max_inflight: int = 4096

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ConfigError("--served-model-name is empty")
        if not self.request_timeout_s > 0:
            raise ConfigError(f"--request-timeout must be > 0, got {self.request_timeout_s}")
        if self.max_attempts < 1 or self.max_inflight < 1:
            raise ConfigError("the processor needs at least one attempt and one in-flight request")


@dataclass(slots=True)
class _Started:
    worker_id: str
    prefill: common_pb2.PrefillLocation


@dataclass(slots=True)
class _Finished:
    completion_tokens: int
    cached_tokens: int


class ProcessorServicer(processor_pb2_grpc.ProcessorServicer):
    def __init__(self, config: ProcessorConfig, tokenizer: ModelTokenizer, routers: RouterClient,
                 channels: ChannelPool) -> None:
        self._config = config
        self._tok = tokenizer
        self._routers = routers
        self._channels = channels
        self.inflight = 0

    async def Generate(  # noqa: N802
        self, request: processor_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[processor_pb2.GenerateResponse]:
        rid = request.request_id or uuid.uuid4().hex
        if request.model != self._config.served_model_name:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.model!r} is not served here")
        if self.inflight >= self._config.max_inflight:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "processor overloaded")
        try:
            tokens = self._tokenize(request)
            sampling = self._checked_sampling(request.sampling, len(tokens))
        except PromptError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self.inflight += 1
        try:
            async for msg in self._generate(rid, request, tokens, sampling):
                yield msg
        except _Failure as exc:
            log.warning("request %s failed: %s", rid, exc.message)
            await context.abort(exc.code, exc.message)
        finally:
            self.inflight -= 1

    # -- input -------------------------------------------------------------------------------

    def _tokenize(self, request: processor_pb2.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("input")
        if kind == "chat":
            turns = [ChatTurn(m.role, m.content, m.name) for m in request.chat.messages]
            tokens = self._tok.encode_chat(turns, request.chat.add_generation_prompt)
        elif kind == "text":
            tokens = self._tok.encode_text(request.text)
        elif kind == "tokens":
            tokens = list(request.tokens.ids)
            self._tok.check_ids(tokens)
        else:
            raise PromptError("the request has no prompt")
        if not tokens:
            raise PromptError("the prompt is empty")
        return tokens

    def _checked_sampling(self, sampling: common_pb2.SamplingParams, prompt_len: int) -> common_pb2.SamplingParams:
        context = self._tok.max_model_len
        if prompt_len >= context:
            raise PromptError(
                f"the prompt has {prompt_len} tokens; this model's context length is {context} tokens"
            )
        out = common_pb2.SamplingParams()
        out.CopyFrom(sampling)
        room = context - prompt_len
        if not out.max_tokens:
            out.max_tokens = room
        elif out.max_tokens > room:
            raise PromptError(
                f"max_tokens ({out.max_tokens}) plus the prompt ({prompt_len} tokens) exceed this model's "
                f"context length of {context} tokens; at most {room} tokens can be generated"
            )
        if out.min_tokens > out.max_tokens:
            raise PromptError(f"min_tokens ({out.min_tokens}) is larger than max_tokens ({out.max_tokens})")
        return out

    # -- routing and generation --------------------------------------------------------------

    async def _route(self, rid: str, tokens: list[int], exclude: list[str]) -> RouteChoice:
        try:
            return await self._routers.route(rid, self._config.served_model_name, tokens,
                                             common_pb2.WORKER_ROLE_DECODE, exclude)
        except NoWorkerError as exc:
            raise _Failure(grpc.StatusCode.UNAVAILABLE, f"no decode worker can take the request: {exc}") from exc
        except RoutingError as exc:
            raise _Failure(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc

    async def _generate(self, rid: str, request: processor_pb2.GenerateRequest, tokens: list[int],
                        sampling: common_pb2.SamplingParams) -> AsyncIterator[processor_pb2.GenerateResponse]:
        route = await self._route(rid, tokens, [])
        n = max(request.n, 1)
        stops = list(request.stop)
        choices = [
            self._choice(f"{rid}-{i}" if n > 1 else rid, request.choice_offset + i, tokens,
                         _choice_sampling(sampling, i), stops, route)
            for i in range(n)
        ]
        completion_tokens = 0
        cached_tokens = 0
        announced = False
        async for item in merge(choices):
            if isinstance(item, _Started):
                if not announced:
                    announced = True
                    yield processor_pb2.GenerateResponse(route=processor_pb2.RouteInfo(
                        worker_id=item.worker_id, prefill=item.prefill, prompt_tokens=len(tokens)))
            elif isinstance(item, _Finished):
                completion_tokens += item.completion_tokens
                cached_tokens = max(cached_tokens, item.cached_tokens)
            elif isinstance(item, processor_pb2.ChoiceDelta):
                yield processor_pb2.GenerateResponse(delta=item)
        yield processor_pb2.GenerateResponse(usage=processor_pb2.Usage(
            prompt_tokens=len(tokens), completion_tokens=completion_tokens, cached_tokens=cached_tokens))

    async def _choice(self, rid: str, index: int, tokens: list[int], sampling: common_pb2.SamplingParams,
                      stops: list[str], route: RouteChoice) -> AsyncIterator[object]:
        tried: list[str] = []
        for attempt in range(self._config.max_attempts):
            if attempt:
                route = await self._route(rid, tokens, tried)
            tried.append(route.worker_id)
            started = False
            try:
                async for item in self._stream_from_worker(rid, index, tokens, sampling, stops, route):
                    started = True
                    yield item
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise _Failure(grpc.StatusCode.INVALID_ARGUMENT, exc.details() or "invalid request") from exc
                if started or exc.code() not in RETRYABLE:
                    raise _Failure(grpc.StatusCode.UNAVAILABLE,
                                   f"worker {route.worker_id} failed mid-stream: {exc.code().name}") from exc
                log.warning("request %s: worker %s unavailable (%s); trying another",
                            rid, route.worker_id, exc.code().name)
        raise _Failure(grpc.StatusCode.UNAVAILABLE, f"no worker could serve the request after {len(tried)} attempts")

    async def _stream_from_worker(self, rid: str, index: int, tokens: list[int], sampling: common_pb2.SamplingParams,
                                  stops: list[str], route: RouteChoice) -> AsyncIterator[object]:
        stub = worker_pb2_grpc.WorkerStub(self._channels.get(route.address))
        call = stub.Generate(
            worker_pb2.WorkerGenerateRequest(request_id=rid, token_ids=tokens, sampling=sampling,
                                             prefix_hit_rate=route.prefix_hit_rate),
            timeout=self._config.request_timeout_s,
        )
        detok = IncrementalDetokenizer(self._tok.decode)
        stopper = StopStrings(stops)
        want_logprobs = sampling.HasField("logprobs")
        generated = 0
        cached = 0
        first = True
        try:
            async for msg in call:
                if first:
                    first = False
                    cached = msg.cached_tokens
                    yield _Started(route.worker_id, msg.prefill)
                if msg.finish_reason == "abort":
                    raise _Failure(grpc.StatusCode.UNAVAILABLE, f"worker {route.worker_id} aborted the request")
                ids = list(msg.token_ids)
                generated += len(ids)
                text = detok.push(ids) if ids else ""
                if msg.finish_reason:
                    text += detok.flush()
                out, stopped = stopper.push(text)
                finish = "stop" if stopped else ""
                if msg.finish_reason and not stopped:
                    out += stopper.flush()
                    finish = msg.finish_reason
                delta = processor_pb2.ChoiceDelta(index=index, text=out, token_ids=ids, finish_reason=finish)
                if want_logprobs:
                    delta.logprobs.extend(msg.logprobs)
                    for lp in delta.logprobs:
                        for top in lp.top:
                            top.text = self._tok.token_text(top.token_id)
                    delta.token_texts.extend(self._tok.token_text(t) for t in ids)
                if out or finish or want_logprobs:
                    yield delta
                if finish:
                    break
        finally:
            call.cancel()
        yield _Finished(generated, cached)


class _Failure(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _choice_sampling(sampling: common_pb2.SamplingParams, index: int) -> common_pb2.SamplingParams:
    """Choice i of a seeded request uses seed+i, so `n` seeded choices differ but stay reproducible."""
    if index == 0 or not sampling.HasField("seed"):
        return sampling
    out = common_pb2.SamplingParams()
    out.CopyFrom(sampling)
    out.seed = sampling.seed + index
    return out
