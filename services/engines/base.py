"""The one interface every engine implements, and the plain data that crosses it.

Engines know nothing of gRPC or etcd: the worker services translate protobuf to these types.
"""

from __future__ import annotations

import abc
import enum
import time
from collections.abc import AsyncGenerator, Callable, Collection, Iterable
from dataclasses import dataclass, field

from services.engines.lora import AdapterSet
from services.kv_protocol.events import KvEventData
from services.kv_protocol.media import MediaSpan


@dataclass(frozen=True, slots=True)
class Structured:
    """A constraint on the output: `kind` is json (a schema as JSON text), json_object, regex,
    choice or grammar; `param` the request field it came from, for a refusal to name."""

    kind: str
    value: str | tuple[str, ...] | None = None
    param: str = "structured_outputs"


@dataclass(frozen=True, slots=True)
class Sampling:
    max_tokens: int = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    bad_words: tuple[str, ...] = ()
    structured: Structured | None = None

    def shaping_fields(self) -> list[str]:
        """The set fields that reshape the token distribution (penalties, biases, constraints),
        by their API names: what an engine that does not sample from a distribution cannot honour."""
        named = [name for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
                 if getattr(self, name) is not None]
        named += [name for name in ("logit_bias", "bad_words") if getattr(self, name)]
        if self.structured is not None:
            named.append(self.structured.param)
        return named


class EngineBusy(Exception):
    """The engine has no room for this call now (KV memory held for other requests); another
    worker, or this one a moment later, may take it."""


class UnsupportedFieldError(ValueError):
    """The engine cannot honour a request field; `param` names it (the HTTP error's `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    token_ids: list[int]
    sampling: Sampling
    # Set when a prefill worker computed this prompt's KV: what the engine needs to pull it.
    kv_pull: dict | None = None
    # A request moved from another worker: the last `resumed_tokens` of token_ids are output it
    # already generated there, to be continued as if the sequence had never broken.
    resumed_tokens: int = 0
    # The LoRA adapter to run with ("" for the base model); the engine's `adapters` must know it.
    lora_name: str = ""
    # The agent session it belongs to, when the router bound one: what to keep once it ends.
    session: SessionRetention | None = None
    # The prompt's images, in prompt order: each fills the placeholder tokens of its span.
    media: tuple[MediaInput, ...] = ()

    def spans(self) -> tuple[MediaSpan, ...]:
        """Where its images stand: its blocks hash with them (services/kv_protocol/media.py)."""
        return tuple(item.span for item in self.media)


def distinct_images(media: Iterable[MediaInput]) -> list[MediaInput]:
    """Each image once (where it first stands), however often a prompt holds it: what to encode,
    or hand over, once."""
    first: dict[int, MediaInput] = {}
    for item in media:
        first.setdefault(item.span.digest, item)
    return list(first.values())


@dataclass(frozen=True, slots=True)
class EncodedImage:
    """An encode worker's image: where its features are held for a pull (engine-defined, JSON
    serialisable, as PrefillResult.kv_pull), and whether they were in its encoder cache already."""

    features: dict
    cached: bool = False


@dataclass(frozen=True, slots=True)
class MediaInput:
    """One image of a prompt: its bytes as the client sent them, its size, and its span."""

    span: MediaSpan
    data: bytes
    media_type: str
    width: int
    height: int


@dataclass(frozen=True, slots=True)
class SessionRetention:
    """Keep a session's blocks (the request's prompt and output) for `retain_s` after the request
    ends, for the session's next request: an engine that can (the mocker) pins them on the device
    within its budget, else keeps them in its host tier; one that cannot ignores it."""

    session_id: str
    retain_s: float


# A KV pull's deadline: this floor plus its size at this rate. A link that slow, or a peer cut off
# mid-transfer, costs the request at most that long before it is computed locally instead; a
# holder that cannot see the pull keeps the KV that long (vllm_moves.py).
PULL_FLOOR_S = 3.0
PULL_MIN_BYTES_PER_S = 25e6


def pull_deadline_s(nbytes: int) -> float:
    """How long a pull of `nbytes` of KV may take."""
    return PULL_FLOOR_S + nbytes / PULL_MIN_BYTES_PER_S


@dataclass(frozen=True, slots=True)
class PrefillResult:
    # What a decode engine needs to pull the prompt's KV (engine-specific, JSON-serialisable).
    kv_pull: dict
    # Prompt tokens found in this engine's own prefix cache.
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class FinishReason(enum.StrEnum):
    """Why a request's generation ended. STOP and LENGTH travel on (common.proto's FinishReason);
    ABORT (the engine dropped the request: cancelled, or lost with its worker) does not: the
    worker ends the call with OUTCOME_PEER_FAILED instead, and the processor moves the request.
    MOVED (handed over at a drain, `Engine.move_out`) does not either: the output's `kv_pull`
    says where its KV is held, and the worker sends it as the call's handoff."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    MOVED = "moved"


@dataclass(slots=True)
class EngineOutput:
    """Tokens produced since the previous output of the same request."""

    token_ids: list[int]
    finish_reason: FinishReason | None = None  # on the last output only
    cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    # Set by a prefill run on its last output: what a decode engine needs to pull the KV.
    kv_pull: dict | None = None


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """A worker's load, read from the engine's own stats: what the router's cost function and the
    metrics report (active/total request slots and KV blocks, waiting requests, KV cache usage,
    prefix-cache hit rate)."""

    request_active_slots: int = 0
    request_total_slots: int = 0
    kv_active_blocks: int = 0
    kv_total_blocks: int = 0
    num_requests_waiting: int = 0
    gpu_cache_usage_perc: float = 0.0
    gpu_prefix_cache_hit_rate: float = 0.0
    host_tier: HostTierLoad | None = None
    prefill_cost: PrefillCost | None = None
    # Agent sessions' pinned KV (engines that keep it: the mocker).
    sessions: SessionPinLoad | None = None
    # Its image encoder's work (engines that count it: the mocker).
    images: ImageLoad | None = None


@dataclass(frozen=True, slots=True)
class HostTierLoad:
    """A worker's host-memory KV tier: its fill, the link a load-back crosses, and its hits."""

    active_blocks: int
    total_blocks: int
    load_gbps: float
    kv_bytes_per_token: int
    hit_blocks_total: int


@dataclass(frozen=True, slots=True)
class ImageLoad:
    """Since start: images encoded, found in the encoder cache (features kept from an earlier
    request), and needing no encoding at all (their tokens were in cached KV blocks)."""

    encoded_total: int
    encoder_cache_hits_total: int
    kv_hits_total: int
    # Features pulled from an encode worker (E/P/D) instead of encoded here.
    taken_total: int = 0
    # The images (digests) whose features the encoder cache holds now.
    cached: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True)
class SessionPinLoad:
    """The KV an engine keeps for idle agent sessions (SessionRetention): live pins, device blocks
    pinned (within `device_budget`), host-tier blocks protected from its LRU drop, and the blocks
    brought back ahead of a session's request and demoted from the device past the budget."""

    pins: int
    device_blocks: int
    device_budget: int
    host_blocks: int
    prefetched_blocks_total: int
    demoted_blocks_total: int


@dataclass(frozen=True, slots=True)
class PrefillCost:
    """What a prompt token costs to prefill on this worker: `kv_tier.prefill_seconds` states the rule."""

    us_per_token: float
    us_per_token_per_1k: float = 0.0


KvEventSink = Callable[[KvEventData], None]
# (bytes, seconds) of each KV transfer this engine received.
KvTransferSink = Callable[[int, float], None]


@dataclass(frozen=True)
class EngineInfo:
    model_dir: str
    served_model_name: str
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)


class Engine(abc.ABC):
    """An inference engine: generates tokens for token prompts and reports its cache and load."""

    name: str
    info: EngineInfo
    # The LoRA adapters the engine knows and keeps loaded; None when started without LoRA.
    adapters: AdapterSet | None = None

    @abc.abstractmethod
    async def start(self) -> None:
        """Loads and warms the engine; returns when it can serve."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Aborts everything in flight and releases the engine's resources."""

    @abc.abstractmethod
    def generate(self, request: EngineRequest, tap: RowTap | None = None) -> AsyncGenerator[EngineOutput, None]:
        """Streams outputs; closing the iterator early aborts the request in the engine. `tap`:
        where the engine's step may deliver plain outputs itself once the caller opens it
        (output_channel.py); an engine that cannot ignores it and streams them all."""

    @abc.abstractmethod
    def load(self) -> LoadSnapshot:
        """Current load, cheap enough to call on every metrics tick."""

    @abc.abstractmethod
    async def check_health(self) -> None:
        """Returns if the engine can serve; raises, saying why, once it cannot (its step loop
        died, its engine processes are gone)."""

    async def prefill(self, request: EngineRequest) -> PrefillResult:
        """Computes the prompt's KV and keeps it for a decode engine to pull (prefill workers)."""
        raise NotImplementedError(f"the {self.name} engine was not started for remote prefill")

    async def release_kv(self, request_id: str) -> bool:
        """Frees KV held for a decode side that gave up; False if nothing was held."""
        return False

    # -- moving running requests (a drain) -----------------------------------------------------

    @property
    def can_move(self) -> bool:
        """Whether `move_out` hands requests over with their KV (an engine that cannot keep and
        export a running request's blocks says no: its drain waits for its requests instead)."""
        return False

    async def move_out(self, request_ids: Collection[str] | None = None) -> int:
        """Stops every request in flight (or those of `request_ids`) at a step boundary and hands
        it over: each one's last
        output has finish reason MOVED and, in `kv_pull`, where the engine holds the KV of its
        tokens so far for the next worker to pull (None: it holds none, the request had not
        started); its blocks stay taken until that pull or `moves_unpulled`'s expiry. Returns
        how many were handed over."""
        return 0

    def moves_unpulled(self) -> int:
        """Requests handed over whose KV no worker has pulled yet (nor has its hold expired): what
        a drain waits for before the engine stops."""
        return 0

    # -- the encode stage (E/P/D) --------------------------------------------------------------

    def to_encode(self, request: EngineRequest) -> list[MediaInput]:
        """The request's images this engine would encode itself (not in its encoder cache, not
        all in cached blocks), for an encode worker to encode instead; an engine that cannot take
        features from elsewhere says none (it encodes in place)."""
        return []

    async def encode(self, request_id: str, item: MediaInput) -> EncodedImage:
        """Encodes one image (an encode worker) and keeps its features for a peer to pull."""
        raise NotImplementedError(f"the {self.name} engine does not serve as an encode worker")

    async def take_features(self, item: MediaInput, features: dict) -> None:
        """Pulls an image's features an encode worker holds (`EncodedImage.features`) into this
        engine's encoder cache, so its prefill encodes nothing for it."""
        raise NotImplementedError(f"the {self.name} engine takes no features from an encode worker")

    def set_kv_event_sink(self, sink: KvEventSink) -> None:
        """Receives every change to the engine's prefix cache, in order."""
        self._kv_sink = sink

    def emit_kv_event(self, event: KvEventData) -> None:
        sink = getattr(self, "_kv_sink", None)
        if sink is not None:
            sink(event)

    def set_kv_transfer_sink(self, sink: KvTransferSink) -> None:
        """Receives (bytes, seconds) of every KV cache transfer into this engine."""
        self._transfer_sink = sink

    def record_kv_transfer(self, nbytes: int, seconds: float) -> None:
        sink = getattr(self, "_transfer_sink", None)
        if sink is not None:
            sink(nbytes, seconds)


class RowTap:
    """Where an engine may deliver a request's plain outputs itself (see output_channel.py):
    the mocker from its step (OutputChannel), vLLM from its output loop (vllm_row_tap.py).
    Closed until the consumer opens it; engines that cannot use it ignore it. `clock`: what the
    pacing interval is measured on (the stream's pacing clock, worker/pacing.py)."""

    __slots__ = ("_to", "_interval_s", "_last", "_closed", "_clock")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._to: Callable[[list[int]], None] | None = None
        self._closed = False
        self._interval_s = 0.0
        self._last = 0.0
        self._clock = clock

    def open(self, to: Callable[[list[int]], None], interval_s: float) -> None:
        """From now on plain outputs may go to `to`: the caller's chain up to it has no buffer."""
        if not self._closed:
            self._to, self._interval_s, self._last = to, interval_s, self._clock()

    def close(self) -> None:
        """For good: the chain may buffer outputs from now on (pacing merges them)."""
        self._to = None
        self._closed = True

    def take(self, out: EngineOutput) -> bool:
        """Delivers `out` through the tap if it is open and `out` may go that way."""
        to = self._to
        if to is None or out.finish_reason is not None or out.logprobs is not None or out.kv_pull is not None:
            return False
        now = self._clock()
        if now - self._last < self._interval_s:
            self.close()  # outputs come faster than the pacing: they take the chain from now on
            return False
        self._last = now
        to(out.token_ids)
        return True
