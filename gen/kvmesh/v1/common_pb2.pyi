from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_ENCODE: _ClassVar[WorkerRole]

class SessionRoute(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_ROUTE_UNSPECIFIED: _ClassVar[SessionRoute]
    SESSION_ROUTE_NEW: _ClassVar[SessionRoute]
    SESSION_ROUTE_BOUND: _ClassVar[SessionRoute]
    SESSION_ROUTE_MOVED: _ClassVar[SessionRoute]
    SESSION_ROUTE_PARENT: _ClassVar[SessionRoute]

class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTCOME_OK: _ClassVar[Outcome]
    OUTCOME_PEER_GONE: _ClassVar[Outcome]
    OUTCOME_PEER_DRAINING: _ClassVar[Outcome]
    OUTCOME_PEER_FAILED: _ClassVar[Outcome]
    OUTCOME_OVERLOADED: _ClassVar[Outcome]
    OUTCOME_NO_CAPACITY: _ClassVar[Outcome]
    OUTCOME_BAD_REQUEST: _ClassVar[Outcome]
    OUTCOME_CONTEXT_TOO_LONG: _ClassVar[Outcome]
    OUTCOME_NO_WORKER: _ClassVar[Outcome]
    OUTCOME_MODEL_NOT_SERVED: _ClassVar[Outcome]
    OUTCOME_DEADLINE: _ClassVar[Outcome]
    OUTCOME_READ_TOO_SLOWLY: _ClassVar[Outcome]
    OUTCOME_CANCELLED: _ClassVar[Outcome]
    OUTCOME_UNSUPPORTED: _ClassVar[Outcome]
    OUTCOME_SESSION_FULL: _ClassVar[Outcome]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]

class Overload(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OVERLOAD_UNSPECIFIED: _ClassVar[Overload]
    OVERLOAD_PREDICTED_LATENCY: _ClassVar[Overload]
    OVERLOAD_QUEUE_FULL: _ClassVar[Overload]
    OVERLOAD_QUEUE_EXPIRED: _ClassVar[Overload]
    OVERLOAD_TENANT_CONCURRENCY: _ClassVar[Overload]
    OVERLOAD_TENANT_TOKENS: _ClassVar[Overload]
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_ENCODE: WorkerRole
SESSION_ROUTE_UNSPECIFIED: SessionRoute
SESSION_ROUTE_NEW: SessionRoute
SESSION_ROUTE_BOUND: SessionRoute
SESSION_ROUTE_MOVED: SessionRoute
SESSION_ROUTE_PARENT: SessionRoute
OUTCOME_OK: Outcome
OUTCOME_PEER_GONE: Outcome
OUTCOME_PEER_DRAINING: Outcome
OUTCOME_PEER_FAILED: Outcome
OUTCOME_OVERLOADED: Outcome
OUTCOME_NO_CAPACITY: Outcome
OUTCOME_BAD_REQUEST: Outcome
OUTCOME_CONTEXT_TOO_LONG: Outcome
OUTCOME_NO_WORKER: Outcome
OUTCOME_MODEL_NOT_SERVED: Outcome
OUTCOME_DEADLINE: Outcome
OUTCOME_READ_TOO_SLOWLY: Outcome
OUTCOME_CANCELLED: Outcome
OUTCOME_UNSUPPORTED: Outcome
OUTCOME_SESSION_FULL: Outcome
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason
OVERLOAD_UNSPECIFIED: Overload
OVERLOAD_PREDICTED_LATENCY: Overload
OVERLOAD_QUEUE_FULL: Overload
OVERLOAD_QUEUE_EXPIRED: Overload
OVERLOAD_TENANT_CONCURRENCY: Overload
OVERLOAD_TENANT_TOKENS: Overload

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "min_tokens", "logprobs", "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias", "bad_words", "structured")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    ignore_eos: bool
    min_tokens: int
    logprobs: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    logit_bias: _containers.ScalarMap[int, float]
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    structured: StructuredOutput
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., bad_words: _Optional[_Iterable[str]] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar", "param")
    class Choices(_message.Message):
        __slots__ = ("choices",)
        CHOICES_FIELD_NUMBER: _ClassVar[int]
        choices: _containers.RepeatedScalarFieldContainer[str]
        def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    PARAM_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: StructuredOutput.Choices
    grammar: str
    param: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[StructuredOutput.Choices, _Mapping]] = ..., grammar: _Optional[str] = ..., param: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "text")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    text: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., text: _Optional[str] = ...) -> None: ...

class PrefillLocation(_message.Message):
    __slots__ = ("site", "prefill_worker_id")
    class Site(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        SITE_UNSPECIFIED: _ClassVar[PrefillLocation.Site]
        SITE_LOCAL: _ClassVar[PrefillLocation.Site]
        SITE_REMOTE: _ClassVar[PrefillLocation.Site]
    SITE_UNSPECIFIED: PrefillLocation.Site
    SITE_LOCAL: PrefillLocation.Site
    SITE_REMOTE: PrefillLocation.Site
    SITE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    site: PrefillLocation.Site
    prefill_worker_id: str
    def __init__(self, site: _Optional[_Union[PrefillLocation.Site, str]] = ..., prefill_worker_id: _Optional[str] = ...) -> None: ...

class RouteExplanation(_message.Message):
    __slots__ = ("mode", "candidates", "lora_name", "session")
    MODE_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    mode: str
    candidates: _containers.RepeatedCompositeFieldContainer[RouteCandidate]
    lora_name: str
    session: SessionRoute
    def __init__(self, mode: _Optional[str] = ..., candidates: _Optional[_Iterable[_Union[RouteCandidate, _Mapping]]] = ..., lora_name: _Optional[str] = ..., session: _Optional[_Union[SessionRoute, str]] = ...) -> None: ...

class SessionRef(_message.Message):
    __slots__ = ("id", "parent_id", "retain_ms")
    ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    RETAIN_MS_FIELD_NUMBER: _ClassVar[int]
    id: str
    parent_id: str
    retain_ms: int
    def __init__(self, id: _Optional[str] = ..., parent_id: _Optional[str] = ..., retain_ms: _Optional[int] = ...) -> None: ...

class RouteCandidate(_message.Message):
    __slots__ = ("worker_id", "overlap_blocks", "cache_usage", "waiting", "logit", "host_overlap_blocks", "host_credit", "kv_source", "recent_accuracy", "adapter_resident", "adapter_load_s", "encoder_blocks")
    class KvSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KV_SOURCE_UNSPECIFIED: _ClassVar[RouteCandidate.KvSource]
        KV_SOURCE_EVENTS: _ClassVar[RouteCandidate.KvSource]
        KV_SOURCE_PREDICTED: _ClassVar[RouteCandidate.KvSource]
    KV_SOURCE_UNSPECIFIED: RouteCandidate.KvSource
    KV_SOURCE_EVENTS: RouteCandidate.KvSource
    KV_SOURCE_PREDICTED: RouteCandidate.KvSource
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    LOGIT_FIELD_NUMBER: _ClassVar[int]
    HOST_OVERLAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_CREDIT_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    RECENT_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_LOAD_S_FIELD_NUMBER: _ClassVar[int]
    ENCODER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    overlap_blocks: int
    cache_usage: float
    waiting: int
    logit: float
    host_overlap_blocks: int
    host_credit: float
    kv_source: RouteCandidate.KvSource
    recent_accuracy: float
    adapter_resident: bool
    adapter_load_s: float
    encoder_blocks: float
    def __init__(self, worker_id: _Optional[str] = ..., overlap_blocks: _Optional[int] = ..., cache_usage: _Optional[float] = ..., waiting: _Optional[int] = ..., logit: _Optional[float] = ..., host_overlap_blocks: _Optional[int] = ..., host_credit: _Optional[float] = ..., kv_source: _Optional[_Union[RouteCandidate.KvSource, str]] = ..., recent_accuracy: _Optional[float] = ..., adapter_resident: _Optional[bool] = ..., adapter_load_s: _Optional[float] = ..., encoder_blocks: _Optional[float] = ...) -> None: ...

class StreamEnd(_message.Message):
    __slots__ = ("stream_id", "outcome", "message", "param", "retry_after_ms", "overload")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PARAM_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    OVERLOAD_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    outcome: Outcome
    message: str
    param: str
    retry_after_ms: int
    overload: Overload
    def __init__(self, stream_id: _Optional[int] = ..., outcome: _Optional[_Union[Outcome, str]] = ..., message: _Optional[str] = ..., param: _Optional[str] = ..., retry_after_ms: _Optional[int] = ..., overload: _Optional[_Union[Overload, str]] = ...) -> None: ...

class Qos(_message.Message):
    __slots__ = ("priority", "tenant", "ttft_objective_ms", "outside_queue_ms")
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TTFT_OBJECTIVE_MS_FIELD_NUMBER: _ClassVar[int]
    OUTSIDE_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    priority: int
    tenant: str
    ttft_objective_ms: int
    outside_queue_ms: int
    def __init__(self, priority: _Optional[int] = ..., tenant: _Optional[str] = ..., ttft_objective_ms: _Optional[int] = ..., outside_queue_ms: _Optional[int] = ...) -> None: ...

class MediaSpan(_message.Message):
    __slots__ = ("digest", "offset", "length")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    digest: int
    offset: int
    length: int
    def __init__(self, digest: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class MediaItem(_message.Message):
    __slots__ = ("span", "data", "media_type", "width", "height")
    SPAN_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MEDIA_TYPE_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    span: MediaSpan
    data: bytes
    media_type: str
    width: int
    height: int
    def __init__(self, span: _Optional[_Union[MediaSpan, _Mapping]] = ..., data: _Optional[bytes] = ..., media_type: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ...) -> None: ...
