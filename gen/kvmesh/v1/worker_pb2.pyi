from gen.kvmesh.v1 import common_pb2 as _common_pb2
from gen.kvmesh.v1 import json_value_pb2 as _json_value_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TIER_UNSPECIFIED: _ClassVar[KvTier]
    KV_TIER_DEVICE: _ClassVar[KvTier]
    KV_TIER_HOST: _ClassVar[KvTier]
KV_TIER_UNSPECIFIED: KvTier
KV_TIER_DEVICE: KvTier
KV_TIER_HOST: KvTier

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path", "load")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    load: bool
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., load: _Optional[bool] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class LoraAdapterState(_message.Message):
    __slots__ = ("lora_name", "lora_path", "resident", "size_bytes", "load_s", "active_requests")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    resident: bool
    size_bytes: int
    load_s: float
    active_requests: int
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., resident: _Optional[bool] = ..., size_bytes: _Optional[int] = ..., load_s: _Optional[float] = ..., active_requests: _Optional[int] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "item")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ITEM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    item: _common_pb2.MediaItem
    def __init__(self, request_id: _Optional[str] = ..., item: _Optional[_Union[_common_pb2.MediaItem, _Mapping]] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("features", "cached")
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    features: KvPull
    cached: bool
    def __init__(self, features: _Optional[_Union[KvPull, _Mapping]] = ..., cached: _Optional[bool] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "lora_name", "media")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    lora_name: str
    media: _containers.RepeatedCompositeFieldContainer[_common_pb2.MediaItem]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., lora_name: _Optional[str] = ..., media: _Optional[_Iterable[_Union[_common_pb2.MediaItem, _Mapping]]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("kv_pull", "cached_tokens")
    KV_PULL_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    kv_pull: KvPull
    cached_tokens: int
    def __init__(self, kv_pull: _Optional[_Union[KvPull, _Mapping]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class KvPull(_message.Message):
    __slots__ = ("params",)
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    params: _json_value_pb2.JsonValue
    def __init__(self, params: _Optional[_Union[_json_value_pb2.JsonValue, _Mapping]] = ...) -> None: ...

class PrefillCall(_message.Message):
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
    request: PrefillRequest
    def __init__(self, stream_id: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ..., request: _Optional[_Union[PrefillRequest, _Mapping]] = ...) -> None: ...

class PrefillSessionDown(_message.Message):
    __slots__ = ("calls", "cancel")
    CALLS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[PrefillCall]
    cancel: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, calls: _Optional[_Iterable[_Union[PrefillCall, _Mapping]]] = ..., cancel: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("stream_id", "response")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    response: PrefillResponse
    def __init__(self, stream_id: _Optional[int] = ..., response: _Optional[_Union[PrefillResponse, _Mapping]] = ...) -> None: ...

class PrefillSessionUp(_message.Message):
    __slots__ = ("replies", "ends", "sent_unix_ns")
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    ENDS_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[PrefillReply]
    ends: _containers.RepeatedCompositeFieldContainer[_common_pb2.StreamEnd]
    sent_unix_ns: int
    def __init__(self, replies: _Optional[_Iterable[_Union[PrefillReply, _Mapping]]] = ..., ends: _Optional[_Iterable[_Union[_common_pb2.StreamEnd, _Mapping]]] = ..., sent_unix_ns: _Optional[int] = ...) -> None: ...

class ReleaseKvRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseKvResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class WorkerGenerateRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "prefix_hit_rate", "resumed_tokens", "lora_name", "session", "media", "moved_kv", "moved_from")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    MOVED_KV_FIELD_NUMBER: _ClassVar[int]
    MOVED_FROM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    prefix_hit_rate: float
    resumed_tokens: int
    lora_name: str
    session: _common_pb2.SessionRef
    media: _containers.RepeatedCompositeFieldContainer[_common_pb2.MediaItem]
    moved_kv: KvPull
    moved_from: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., prefix_hit_rate: _Optional[float] = ..., resumed_tokens: _Optional[int] = ..., lora_name: _Optional[str] = ..., session: _Optional[_Union[_common_pb2.SessionRef, _Mapping]] = ..., media: _Optional[_Iterable[_Union[_common_pb2.MediaItem, _Mapping]]] = ..., moved_kv: _Optional[_Union[KvPull, _Mapping]] = ..., moved_from: _Optional[str] = ...) -> None: ...

class WorkerGenerateResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "prompt_tokens", "cached_tokens", "prefill", "handoff")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: _common_pb2.FinishReason
    prompt_tokens: int
    cached_tokens: int
    prefill: _common_pb2.PrefillLocation
    handoff: KvPull
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., prefill: _Optional[_Union[_common_pb2.PrefillLocation, _Mapping]] = ..., handoff: _Optional[_Union[KvPull, _Mapping]] = ...) -> None: ...

class SubscribeKvEventsRequest(_message.Message):
    __slots__ = ("from_event_id", "snapshot", "incarnation")
    FROM_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    from_event_id: int
    snapshot: bool
    incarnation: int
    def __init__(self, from_event_id: _Optional[int] = ..., snapshot: _Optional[bool] = ..., incarnation: _Optional[int] = ...) -> None: ...

class StoredBlock(_message.Message):
    __slots__ = ("block_hash", "tokens_hash")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_HASH_FIELD_NUMBER: _ClassVar[int]
    block_hash: int
    tokens_hash: int
    def __init__(self, block_hash: _Optional[int] = ..., tokens_hash: _Optional[int] = ...) -> None: ...

class BlocksStored(_message.Message):
    __slots__ = ("parent_hash", "blocks", "tier", "lora_name")
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    parent_hash: int
    blocks: _containers.RepeatedCompositeFieldContainer[StoredBlock]
    tier: KvTier
    lora_name: str
    def __init__(self, parent_hash: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[StoredBlock, _Mapping]]] = ..., tier: _Optional[_Union[KvTier, str]] = ..., lora_name: _Optional[str] = ...) -> None: ...

class BlocksRemoved(_message.Message):
    __slots__ = ("block_hashes", "tier")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    tier: KvTier
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., tier: _Optional[_Union[KvTier, str]] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("event_id", "stored", "removed", "cleared")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    event_id: int
    stored: BlocksStored
    removed: BlocksRemoved
    cleared: AllBlocksCleared
    def __init__(self, event_id: _Optional[int] = ..., stored: _Optional[_Union[BlocksStored, _Mapping]] = ..., removed: _Optional[_Union[BlocksRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("events", "snapshot", "instance_id", "incarnation")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    snapshot: bool
    instance_id: str
    incarnation: int
    def __init__(self, events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ..., snapshot: _Optional[bool] = ..., instance_id: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class SubscribeMetricsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadMetrics(_message.Message):
    __slots__ = ("request_active_slots", "request_total_slots", "kv_active_blocks", "kv_total_blocks", "num_requests_waiting", "gpu_cache_usage_perc", "gpu_prefix_cache_hit_rate", "host_tier", "prefill_cost", "lora_adapters", "max_loras", "encoder_cache")
    REQUEST_ACTIVE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_TOTAL_SLOTS_FIELD_NUMBER: _ClassVar[int]
    KV_ACTIVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    GPU_CACHE_USAGE_PERC_FIELD_NUMBER: _ClassVar[int]
    GPU_PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COST_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_CACHE_FIELD_NUMBER: _ClassVar[int]
    request_active_slots: int
    request_total_slots: int
    kv_active_blocks: int
    kv_total_blocks: int
    num_requests_waiting: int
    gpu_cache_usage_perc: float
    gpu_prefix_cache_hit_rate: float
    host_tier: HostKvTier
    prefill_cost: PrefillCost
    lora_adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapterState]
    max_loras: int
    encoder_cache: EncoderCache
    def __init__(self, request_active_slots: _Optional[int] = ..., request_total_slots: _Optional[int] = ..., kv_active_blocks: _Optional[int] = ..., kv_total_blocks: _Optional[int] = ..., num_requests_waiting: _Optional[int] = ..., gpu_cache_usage_perc: _Optional[float] = ..., gpu_prefix_cache_hit_rate: _Optional[float] = ..., host_tier: _Optional[_Union[HostKvTier, _Mapping]] = ..., prefill_cost: _Optional[_Union[PrefillCost, _Mapping]] = ..., lora_adapters: _Optional[_Iterable[_Union[LoraAdapterState, _Mapping]]] = ..., max_loras: _Optional[int] = ..., encoder_cache: _Optional[_Union[EncoderCache, _Mapping]] = ...) -> None: ...

class EncoderCache(_message.Message):
    __slots__ = ("digests",)
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    digests: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, digests: _Optional[_Iterable[int]] = ...) -> None: ...

class HostKvTier(_message.Message):
    __slots__ = ("active_blocks", "total_blocks", "load_gbps", "kv_bytes_per_token", "hit_blocks_total")
    ACTIVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOAD_GBPS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    active_blocks: int
    total_blocks: int
    load_gbps: float
    kv_bytes_per_token: int
    hit_blocks_total: int
    def __init__(self, active_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., load_gbps: _Optional[float] = ..., kv_bytes_per_token: _Optional[int] = ..., hit_blocks_total: _Optional[int] = ...) -> None: ...

class PrefillCost(_message.Message):
    __slots__ = ("us_per_token", "us_per_token_per_1k")
    US_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    US_PER_TOKEN_PER_1K_FIELD_NUMBER: _ClassVar[int]
    us_per_token: float
    us_per_token_per_1k: float
    def __init__(self, us_per_token: _Optional[float] = ..., us_per_token_per_1k: _Optional[float] = ...) -> None: ...

class SwitchRoleRequest(_message.Message):
    __slots__ = ("role", "drain_timeout_s")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    role: _common_pb2.WorkerRole
    drain_timeout_s: float
    def __init__(self, role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., drain_timeout_s: _Optional[float] = ...) -> None: ...

class SwitchRoleResponse(_message.Message):
    __slots__ = ("previous_role", "role", "finished", "ended", "handed_over")
    PREVIOUS_ROLE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    HANDED_OVER_FIELD_NUMBER: _ClassVar[int]
    previous_role: _common_pb2.WorkerRole
    role: _common_pb2.WorkerRole
    finished: int
    ended: int
    handed_over: int
    def __init__(self, previous_role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., finished: _Optional[int] = ..., ended: _Optional[int] = ..., handed_over: _Optional[int] = ...) -> None: ...

class WorkerCall(_message.Message):
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
    request: WorkerGenerateRequest
    def __init__(self, stream_id: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ..., request: _Optional[_Union[WorkerGenerateRequest, _Mapping]] = ...) -> None: ...

class WorkerSessionDown(_message.Message):
    __slots__ = ("calls", "cancel", "accepts_rows")
    CALLS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_ROWS_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[WorkerCall]
    cancel: _containers.RepeatedScalarFieldContainer[int]
    accepts_rows: bool
    def __init__(self, calls: _Optional[_Iterable[_Union[WorkerCall, _Mapping]]] = ..., cancel: _Optional[_Iterable[int]] = ..., accepts_rows: _Optional[bool] = ...) -> None: ...

class WorkerReply(_message.Message):
    __slots__ = ("stream_id", "response")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    response: WorkerGenerateResponse
    def __init__(self, stream_id: _Optional[int] = ..., response: _Optional[_Union[WorkerGenerateResponse, _Mapping]] = ...) -> None: ...

class TokenRows(_message.Message):
    __slots__ = ("stream_ids", "counts", "token_ids")
    STREAM_IDS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    stream_ids: _containers.RepeatedScalarFieldContainer[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, stream_ids: _Optional[_Iterable[int]] = ..., counts: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkerSessionUp(_message.Message):
    __slots__ = ("replies", "ends", "rows", "sent_unix_ns")
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    ENDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[WorkerReply]
    ends: _containers.RepeatedCompositeFieldContainer[_common_pb2.StreamEnd]
    rows: TokenRows
    sent_unix_ns: int
    def __init__(self, replies: _Optional[_Iterable[_Union[WorkerReply, _Mapping]]] = ..., ends: _Optional[_Iterable[_Union[_common_pb2.StreamEnd, _Mapping]]] = ..., rows: _Optional[_Union[TokenRows, _Mapping]] = ..., sent_unix_ns: _Optional[int] = ...) -> None: ...
