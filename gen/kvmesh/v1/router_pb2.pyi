from gen.kvmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RouteRequest(_message.Message):
    __slots__ = ("request_id", "model", "token_ids", "role", "exclude_worker_ids", "explain", "hold", "qos", "streams", "max_tokens", "queue_timeout_ms", "feedback", "lora_name", "session", "media", "avoid_worker_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    EXPLAIN_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    QOS_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    FEEDBACK_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    AVOID_WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    role: _common_pb2.WorkerRole
    exclude_worker_ids: _containers.RepeatedScalarFieldContainer[str]
    explain: bool
    hold: bool
    qos: _common_pb2.Qos
    streams: int
    max_tokens: int
    queue_timeout_ms: int
    feedback: _containers.RepeatedCompositeFieldContainer[RouteFeedback]
    lora_name: str
    session: _common_pb2.SessionRef
    media: _containers.RepeatedCompositeFieldContainer[_common_pb2.MediaSpan]
    avoid_worker_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., exclude_worker_ids: _Optional[_Iterable[str]] = ..., explain: _Optional[bool] = ..., hold: _Optional[bool] = ..., qos: _Optional[_Union[_common_pb2.Qos, _Mapping]] = ..., streams: _Optional[int] = ..., max_tokens: _Optional[int] = ..., queue_timeout_ms: _Optional[int] = ..., feedback: _Optional[_Iterable[_Union[RouteFeedback, _Mapping]]] = ..., lora_name: _Optional[str] = ..., session: _Optional[_Union[_common_pb2.SessionRef, _Mapping]] = ..., media: _Optional[_Iterable[_Union[_common_pb2.MediaSpan, _Mapping]]] = ..., avoid_worker_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RouteFeedback(_message.Message):
    __slots__ = ("request_id", "worker_id", "cached_tokens", "prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    worker_id: str
    cached_tokens: int
    prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("worker_id", "address", "overlap_blocks", "prefix_hit_rate", "pool_waiting", "explanation", "host_overlap_blocks", "queued", "queue_wait_ms", "session_retain_ms")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    POOL_WAITING_FIELD_NUMBER: _ClassVar[int]
    EXPLANATION_FIELD_NUMBER: _ClassVar[int]
    HOST_OVERLAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    SESSION_RETAIN_MS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    overlap_blocks: int
    prefix_hit_rate: float
    pool_waiting: int
    explanation: _common_pb2.RouteExplanation
    host_overlap_blocks: int
    queued: bool
    queue_wait_ms: int
    session_retain_ms: int
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., overlap_blocks: _Optional[int] = ..., prefix_hit_rate: _Optional[float] = ..., pool_waiting: _Optional[int] = ..., explanation: _Optional[_Union[_common_pb2.RouteExplanation, _Mapping]] = ..., host_overlap_blocks: _Optional[int] = ..., queued: _Optional[bool] = ..., queue_wait_ms: _Optional[int] = ..., session_retain_ms: _Optional[int] = ...) -> None: ...

class FindMatchesRequest(_message.Message):
    __slots__ = ("model", "token_ids", "role", "lora_name")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    model: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    role: _common_pb2.WorkerRole
    lora_name: str
    def __init__(self, model: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., lora_name: _Optional[str] = ...) -> None: ...

class FindMatchesResponse(_message.Message):
    __slots__ = ("scores", "block_size", "host_scores")
    class ScoresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class HostScoresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SCORES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HOST_SCORES_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.ScalarMap[str, int]
    block_size: int
    host_scores: _containers.ScalarMap[str, int]
    def __init__(self, scores: _Optional[_Mapping[str, int]] = ..., block_size: _Optional[int] = ..., host_scores: _Optional[_Mapping[str, int]] = ...) -> None: ...

class RouterCall(_message.Message):
    __slots__ = ("stream_id", "timeout_ms", "metadata", "request")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    timeout_ms: int
    metadata: _containers.ScalarMap[str, str]
    request: RouteRequest
    def __init__(self, stream_id: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ..., request: _Optional[_Union[RouteRequest, _Mapping]] = ...) -> None: ...

class RouterSessionDown(_message.Message):
    __slots__ = ("calls", "cancel")
    CALLS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[RouterCall]
    cancel: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, calls: _Optional[_Iterable[_Union[RouterCall, _Mapping]]] = ..., cancel: _Optional[_Iterable[int]] = ...) -> None: ...

class RouterReply(_message.Message):
    __slots__ = ("stream_id", "response")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    response: RouteResponse
    def __init__(self, stream_id: _Optional[int] = ..., response: _Optional[_Union[RouteResponse, _Mapping]] = ...) -> None: ...

class RouterSessionUp(_message.Message):
    __slots__ = ("replies", "ends", "sent_unix_ns")
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    ENDS_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[RouterReply]
    ends: _containers.RepeatedCompositeFieldContainer[_common_pb2.StreamEnd]
    sent_unix_ns: int
    def __init__(self, replies: _Optional[_Iterable[_Union[RouterReply, _Mapping]]] = ..., ends: _Optional[_Iterable[_Union[_common_pb2.StreamEnd, _Mapping]]] = ..., sent_unix_ns: _Optional[int] = ...) -> None: ...
