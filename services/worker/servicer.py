"""The gRPC face of an engine worker: generate, KV event and load metric streams, LoRA adapters.

Every worker role serves this; the decode worker overrides Generate to decide where the
prefill runs, the prefill worker adds the `Prefiller` service. The engine behind it is vLLM or
the mocker; this module translates between protobuf and the engine's plain types.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import cast
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import aclosing, contextmanager

import grpc

from gen.kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.mesh.grpc_server import as_rpc
from services.mesh.fast_histogram import FastHistogram
from services.mesh.hop_latency import HopLatency
from services.mesh.session_kind import (
    WORKER_SESSION,
    CallError,
    CallInfo,
    TokenRow,
    bad_request,
    call_info,
    token_row_message,
)
from services.mesh.session_server import SessionHub
from services.mesh.etcd_store import StoreUnavailable
from services.mesh.tracing import TRACING_OFF, Tracing
from services.mesh.logs import REQUEST_ID
from services.worker.lora_adapters import (
    ADAPTER_STATUS,
    adapter_refused,
    check_adapter,
    known_adapters,
    load_adapter,
    state_to_proto,
    unload_adapter,
)
from services.mesh.instance_record import InstanceRecord
from services.worker.pacing import DEFAULT_INTERVAL_S, paced
from services.worker.kv_event_log import KvEventLog, NumberedEvent
from services.worker.handoff import handoff_reply, moved_away
from services.engines.base import (
    Engine,
    EngineOutput,
    EngineBusy,
    EngineRequest,
    SessionRetention,
    FinishReason,
    LoadSnapshot,
    MediaInput,
    RowTap,
    Sampling,
    Structured,
)
from services.engines.lora import AdapterError, AdapterState
from services.kv_protocol.events import KvCleared, KvRemoved, KvStored
from services.kv_protocol.media import MediaSpan

log = logging.getLogger(__name__)

METRICS_MAX_INTERVAL_S = 1.0
METRICS_POLL_S = 0.05
GENERATE_RPC = "kvmesh.v1.Worker/Generate"
# What a generation yields: messages, and token rows for the outputs between its first and last.
GenerateReply = worker_pb2.WorkerGenerateResponse | TokenRow


def media_from_proto(items: Sequence[common_pb2.MediaItem], prompt_len: int) -> tuple[MediaInput, ...]:
    """A request's images as an engine takes them; a span outside the prompt is the caller's bug,
    refused before the engine indexes the prompt with it."""
    out: list[MediaInput] = []
    for i, item in enumerate(items):
        span = MediaSpan(item.span.digest, item.span.offset, item.span.length)
        if span.length == 0 or span.end > prompt_len or (out and span.offset < out[-1].span.end):
            raise bad_request(f"media {i}: its span [{span.offset}, {span.end}) does not lie in the prompt "
                              f"({prompt_len} tokens) after the previous image's")
        out.append(MediaInput(span, item.data, item.media_type, item.width, item.height))
    return tuple(out)


def media_to_proto(item: MediaInput) -> common_pb2.MediaItem:
    span = common_pb2.MediaSpan(digest=item.span.digest, offset=item.span.offset, length=item.span.length)
    return common_pb2.MediaItem(span=span, data=item.data, media_type=item.media_type, width=item.width,
                                height=item.height)


def sampling_from_proto(p: common_pb2.SamplingParams) -> Sampling:
    return Sampling(
        max_tokens=p.max_tokens,
        temperature=p.temperature if p.HasField("temperature") else None,
        top_p=p.top_p if p.HasField("top_p") else None,
        top_k=p.top_k if p.HasField("top_k") else None,
        seed=p.seed if p.HasField("seed") else None,
        ignore_eos=p.ignore_eos,
        min_tokens=p.min_tokens,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        stop_token_ids=tuple(p.stop_token_ids),
        presence_penalty=p.presence_penalty if p.HasField("presence_penalty") else None,
        frequency_penalty=p.frequency_penalty if p.HasField("frequency_penalty") else None,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else None,
        min_p=p.min_p if p.HasField("min_p") else None,
        logit_bias=tuple(sorted(p.logit_bias.items())),
        bad_words=tuple(p.bad_words),
        structured=structured_from_proto(p.structured) if p.HasField("structured") else None,
    )


def structured_from_proto(p: common_pb2.StructuredOutput) -> Structured:
    kind = p.WhichOneof("kind")
    value: str | tuple[str, ...] | None
    if kind == "choice":
        value = tuple(p.choice.choices)
    elif kind == "json_object" or kind is None:
        kind, value = "json_object", None
    else:
        value = getattr(p, kind)
    return Structured("json" if kind == "json_schema" else kind, value, p.param or "structured_outputs")


@contextmanager
def engine_refusals() -> Iterator[None]:
    """An engine's refusals of a prefill or an encode as the call's outcomes: a role the engine
    was not started for UNSUPPORTED, no room now NO_CAPACITY, bad input BAD_REQUEST."""
    try:
        yield
    except NotImplementedError as exc:
        raise CallError(common_pb2.OUTCOME_UNSUPPORTED, str(exc)) from None
    except EngineBusy as exc:
        raise CallError(common_pb2.OUTCOME_NO_CAPACITY, str(exc)) from None
    except ValueError as exc:
        raise refused(exc) from None


def refused(exc: ValueError) -> CallError:
    """An engine's refusal of a request, as OUTCOME_BAD_REQUEST naming its field."""
    return bad_request(str(exc), getattr(exc, "param", ""))


# The engine's reasons as the wire has them; ABORT is not one: it ends the call (output_to_proto).
UNFINISHED = common_pb2.FINISH_REASON_UNSPECIFIED
FINISH_REASONS = {FinishReason.STOP: common_pb2.FINISH_REASON_STOP, FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH}


def output_to_proto(out: EngineOutput) -> worker_pb2.WorkerGenerateResponse:
    """One engine output as a reply; an output that says the engine dropped the request ends the
    call instead (OUTCOME_PEER_FAILED: the caller moves the request to another worker). A request
    the engine handed over (MOVED) is a reply with its handoff and no finish reason."""
    reason = out.finish_reason
    if reason is FinishReason.ABORT:
        raise CallError(common_pb2.OUTCOME_PEER_FAILED, "the engine aborted the request")
    if reason is FinishReason.MOVED:
        return handoff_reply(out)
    msg = worker_pb2.WorkerGenerateResponse(
        token_ids=out.token_ids, finish_reason=FINISH_REASONS[reason] if reason is not None else UNFINISHED,
        cached_tokens=out.cached_tokens
    )
    if out.logprobs:
        for lp in out.logprobs:
            msg.logprobs.append(
                common_pb2.TokenLogprob(
                    token_id=lp.token_id,
                    logprob=lp.logprob,
                    top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
                )
            )
    return msg


def event_to_proto(event: NumberedEvent) -> worker_pb2.KvEvent:
    data = event.data
    msg = worker_pb2.KvEvent(event_id=event.event_id)
    if isinstance(data, KvStored):
        stored = msg.stored
        if data.parent_hash is not None:
            stored.parent_hash = data.parent_hash
        stored.blocks.extend(worker_pb2.StoredBlock(block_hash=b, tokens_hash=t) for b, t in data.blocks)
        stored.tier = cast(worker_pb2.KvTier, int(data.tier))
        stored.lora_name = data.lora_name
    elif isinstance(data, KvRemoved):
        msg.removed.block_hashes.extend(data.block_hashes)
        msg.removed.tier = cast(worker_pb2.KvTier, int(data.tier))
    elif isinstance(data, KvCleared):
        msg.cleared.SetInParent()
    return msg


def load_to_proto(load: LoadSnapshot, adapter_states: tuple[AdapterState, ...] = (),
                  max_loras: int = 0, encoder_cache: bool = False) -> worker_pb2.LoadMetrics:
    """`adapter_states`: every LoRA adapter the worker knows, resident or not; `max_loras`: how
    many it keeps loaded (0: LoRA off); `encoder_cache`: with the encoder cache's images (an
    engine that counts images), for a report that must carry them."""
    images = load.images if encoder_cache else None
    return worker_pb2.LoadMetrics(
        encoder_cache=None if images is None else worker_pb2.EncoderCache(digests=sorted(images.cached)),
        lora_adapters=[state_to_proto(s) for s in adapter_states],
        max_loras=max_loras,
        request_active_slots=load.request_active_slots,
        request_total_slots=load.request_total_slots,
        kv_active_blocks=load.kv_active_blocks,
        kv_total_blocks=load.kv_total_blocks,
        num_requests_waiting=load.num_requests_waiting,
        gpu_cache_usage_perc=load.gpu_cache_usage_perc,
        gpu_prefix_cache_hit_rate=load.gpu_prefix_cache_hit_rate,
        host_tier=None if (h := load.host_tier) is None else worker_pb2.HostKvTier(
            active_blocks=h.active_blocks, total_blocks=h.total_blocks, load_gbps=h.load_gbps,
            kv_bytes_per_token=h.kv_bytes_per_token, hit_blocks_total=h.hit_blocks_total),
        prefill_cost=None if (p := load.prefill_cost) is None else worker_pb2.PrefillCost(
            us_per_token=p.us_per_token, us_per_token_per_1k=p.us_per_token_per_1k),
    )


def _cached(load: LoadSnapshot) -> frozenset[int] | None:
    return None if load.images is None else load.images.cached


def request_from_proto(request: worker_pb2.WorkerGenerateRequest) -> EngineRequest:
    """The engine's request; OUTCOME_BAD_REQUEST for one no engine could serve."""
    if not request.token_ids:
        raise bad_request("the prompt is empty")
    if request.sampling.max_tokens < 1:
        raise bad_request("max_tokens must be at least 1")
    if request.sampling.min_tokens > request.sampling.max_tokens:
        raise bad_request(f"min_tokens ({request.sampling.min_tokens}) exceeds max_tokens "
                          f"({request.sampling.max_tokens})")
    if request.resumed_tokens >= len(request.token_ids):
        raise bad_request(f"resumed_tokens ({request.resumed_tokens}) must be fewer than the tokens sent "
                          f"({len(request.token_ids)})")
    session = None
    if request.session.id and request.session.retain_ms:
        session = SessionRetention(request.session.id, request.session.retain_ms / 1000)
    return EngineRequest(request.request_id, list(request.token_ids), sampling_from_proto(request.sampling),
                         resumed_tokens=request.resumed_tokens, lora_name=request.lora_name, session=session,
                         media=media_from_proto(request.media, len(request.token_ids)))


def generate_attributes(request: worker_pb2.WorkerGenerateRequest, worker_id: str) -> dict[str, str | int]:
    """The `decode` span's attributes (built only for a span that records)."""
    return {"kvmesh.request_id": request.request_id, "kvmesh.worker_id": worker_id,
            "kvmesh.prompt_tokens": len(request.token_ids), "kvmesh.resumed_tokens": request.resumed_tokens,
            "kvmesh.lora_name": request.lora_name}


LOCAL_PREFILL = common_pb2.PrefillLocation(site=common_pb2.PrefillLocation.SITE_LOCAL)


def remote_prefill(prefill_worker_id: str) -> common_pb2.PrefillLocation:
    return common_pb2.PrefillLocation(site=common_pb2.PrefillLocation.SITE_REMOTE, prefill_worker_id=prefill_worker_id)


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, engine: Engine, worker_id: str, events: KvEventLog, tracing: Tracing = TRACING_OFF,
                 stream_interval_s: float = DEFAULT_INTERVAL_S, hops: FastHistogram | None = None) -> None:
        """`hops`: where a decode worker records what it adds to a token's latency (hop_latency.py)."""
        self.engine = engine
        self.stream_interval_s = stream_interval_s
        self.worker_id = worker_id
        self.events = events
        self.tracing = tracing
        # Processors' sessions: every request they send, served by `generate`.
        self.sessions = SessionHub(WORKER_SESSION, self.generate,
                                   latency=HopLatency(hops, "decode_worker") if hops is not None else None)
        # The handlers of the endless subscription streams, ended when the worker drains.
        self._subscriptions: set[asyncio.Task[object]] = set()
        # The worker's etcd record, which lists the adapters it knows: set by the runtime once the
        # server is bound (an adapter loaded before that is in the record it builds then).
        self.record: InstanceRecord | None = None

    async def end_subscriptions(self) -> None:
        """Ends the KV event and metrics streams (a drain: they would never finish by themselves
        and hold the server's grace period for nothing); the subscribers resubscribe elsewhere."""
        for task in list(self._subscriptions):
            task.cancel()

    async def stop(self) -> None:
        """Ends work the servicer owns beyond its calls (none here); runs before the engine stops."""

    def _subscribed(self) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._subscriptions.add(task)
            task.add_done_callback(self._subscriptions.discard)

    async def Generate(self, request: worker_pb2.WorkerGenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        async for reply in as_rpc(context, self.generate(request, call_info(context))):
            yield token_row_message(reply) if isinstance(reply, list) else reply

    async def Session(self, frames: AsyncIterator[worker_pb2.WorkerSessionDown],  # noqa: N802
                      context: grpc.aio.ServicerContext) -> None:
        await self.sessions.serve(frames, context)

    async def generate(self, request: worker_pb2.WorkerGenerateRequest, call: CallInfo) -> AsyncIterator[GenerateReply]:
        """One request's responses, for `Generate` and for a call on a session alike."""
        REQUEST_ID.set(request.request_id)  # this call's task: its log lines carry the id
        with self.tracing.server_span("decode", call, GENERATE_RPC) as span:
            if span.is_recording():
                span.set_attributes(generate_attributes(request, self.worker_id))
            engine_request = self.engine_request(request)
            try:
                async for msg in self.stream(engine_request, LOCAL_PREFILL, call.reply):
                    yield msg
            except ValueError as exc:
                raise refused(exc) from exc
            except AdapterError as exc:  # forgotten between the check and the engine's `use`
                raise adapter_refused(exc) from exc

    def engine_request(self, request: worker_pb2.WorkerGenerateRequest) -> EngineRequest:
        """The engine's request; refused at once (a CallError) when no engine could serve it, or
        when it names a LoRA adapter this worker does not know (lora_adapters.check_adapter)."""
        engine_request = request_from_proto(request)
        check_adapter(self.engine, engine_request.lora_name)
        return engine_request

    async def stream(self, engine_request: EngineRequest, prefill: common_pb2.PrefillLocation,
                     reply: Callable[[TokenRow], None] | None = None) -> AsyncGenerator[GenerateReply, None]:
        """The engine's outputs as replies: the first a message that says where the prefill ran,
        the last a message with the finish reason, those between token rows (session_kind.TokenRow)
        unless they carry logprobs.

        `reply`: the session call's outbox (CallInfo.reply), where the engine's step may put the
        rows itself (output_channel.RowTap) once the first message is out; every generator
        between this one and the outbox must hand on what it gets at once."""
        log.debug("request %s: %d prompt tokens", engine_request.request_id, len(engine_request.token_ids))
        tap = RowTap() if reply is not None and engine_request.sampling.logprobs is None else None
        outputs = self.engine.generate(engine_request, tap)
        if engine_request.sampling.max_tokens > 1:  # one output only: nothing to pace
            outputs = paced(outputs, self.stream_interval_s, tap.close if tap is not None else lambda: None)
        async with aclosing(outputs):
            first = await anext(outputs, None)
            if first is None:
                return
            msg = output_to_proto(first)
            msg.prefill.CopyFrom(prefill)
            msg.prompt_tokens = len(engine_request.token_ids)
            yield msg
            if tap is not None and reply is not None and first.finish_reason is None:
                # Closed again, for good, if pacing starts merging (it buffers from then on).
                tap.open(reply, self.stream_interval_s)
            last = first
            async for last in outputs:
                yield last.token_ids if last.finish_reason is None and last.logprobs is None else output_to_proto(last)
            if last.finish_reason is FinishReason.MOVED:
                raise moved_away()

    async def SubscribeKvEvents(self, request: worker_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext):
        self._subscribed()
        events = self.events
        async for batch, is_snapshot in events.subscribe(request.from_event_id, request.snapshot, request.incarnation):
            yield worker_pb2.KvEventBatch(events=[event_to_proto(e) for e in batch], snapshot=is_snapshot,
                                          instance_id=self.worker_id, incarnation=events.incarnation)

    async def SubscribeMetrics(self, request: worker_pb2.SubscribeMetricsRequest, context: grpc.aio.ServicerContext):
        self._subscribed()
        adapters = self.engine.adapters
        max_loras = adapters.config.max_loras if adapters is not None else 0
        last: tuple[LoadSnapshot, tuple[AdapterState, ...]] | None = None
        last_sent = 0.0
        while True:
            # An adapter loaded, unloaded or taken by a request is a change, as a load change is.
            current = (self.engine.load(), tuple(adapters.states()) if adapters is not None else ())
            now = time.monotonic()
            if current != last or now - last_sent >= METRICS_MAX_INTERVAL_S:
                # The encoder cache's images go in the first report and when they changed only.
                yield load_to_proto(*current, max_loras, encoder_cache=last is None or _cached(current[0]) != _cached(last[0]))
                last, last_sent = current, now
            await asyncio.sleep(METRICS_POLL_S)

    async def LoadLoraAdapter(self, request: worker_pb2.LoadLoraAdapterRequest,  # noqa: N802
                              context: grpc.aio.ServicerContext) -> worker_pb2.LoraAdapterState:
        return await self._change_adapters(load_adapter(self.engine, request), request.lora_name, "loaded", context)

    async def UnloadLoraAdapter(self, request: worker_pb2.UnloadLoraAdapterRequest,  # noqa: N802
                                context: grpc.aio.ServicerContext) -> worker_pb2.LoraAdapterState:
        return await self._change_adapters(unload_adapter(self.engine, request), request.lora_name, "unloaded",
                                           context)

    async def _change_adapters(self, change: Awaitable[AdapterState], lora_name: str, verb: str,
                               context: grpc.aio.ServicerContext) -> worker_pb2.LoraAdapterState:
        """Runs a load or unload; a refusal ends the call with its status, a change goes in the record."""
        try:
            state = await change
        except AdapterError as exc:
            log.info("LoRA adapter %r not %s: %s", lora_name, verb, exc)
            # The record is written on a refusal too: a change whose write failed before (the
            # caller retries it, and now hears NOT_FOUND or "known") reaches etcd this way.
            await self._record_adapters(context)
            await context.abort(ADAPTER_STATUS[exc.kind], str(exc))
        await self._record_adapters(context)
        return state_to_proto(state)

    async def _record_adapters(self, context: grpc.aio.ServicerContext) -> None:
        """Puts the adapters the engine knows now in the worker's etcd record."""
        if self.record is None:
            return
        try:
            await self.record.update(lora_adapters=known_adapters(self.engine))
        except StoreUnavailable as exc:
            # The engine has the change; routers learn of it with the record's next write.
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the adapter change is made, but the worker's etcd "
                                                             f"record could not be updated: {exc}")
