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
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "min_tokens", "logprobs", "stop_token_ids")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    ignore_eos: bool
    min_tokens: int
    logprobs: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

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
    __slots__ = ("mode", "candidates")
    MODE_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    mode: str
    candidates: _containers.RepeatedCompositeFieldContainer[RouteCandidate]
    def __init__(self, mode: _Optional[str] = ..., candidates: _Optional[_Iterable[_Union[RouteCandidate, _Mapping]]] = ...) -> None: ...

class RouteCandidate(_message.Message):
    __slots__ = ("worker_id", "overlap_blocks", "cache_usage", "waiting", "logit")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    LOGIT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    overlap_blocks: int
    cache_usage: float
    waiting: int
    logit: float
    def __init__(self, worker_id: _Optional[str] = ..., overlap_blocks: _Optional[int] = ..., cache_usage: _Optional[float] = ..., waiting: _Optional[int] = ..., logit: _Optional[float] = ...) -> None: ...

class StreamEnd(_message.Message):
    __slots__ = ("stream_id", "code", "message", "final")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    code: int
    message: str
    final: bool
    def __init__(self, stream_id: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., final: _Optional[bool] = ...) -> None: ...
