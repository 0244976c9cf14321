"""The one place engines are built, with what their worker must register beside them.

A mocker worker with NIXL KV transfer owns a NIXL agent; peers find it by the agent's metadata,
stored in etcd under the worker's own lease (`/<namespace>/nixl/<instance_id>`), so it
disappears with the worker. vLLM's NixlConnector finds its peers through its own side channel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from services.engines.base import Engine
from services.engines.mocker.config import MockerConfig
from services.engines.mocker.engine import MockerEngine
from services.engines.mocker.kv_transfer import NixlKvEndpoint, nixl_metadata_key
from services.engines.mocker.timing import TimingModel
from services.mesh.etcd_store import KeyValueStore
from services.mesh.net import port_for_later
from services.worker.engine_flags import EngineConfig

MOCKER_MAX_NUM_SEQS = 256
VLLM_MAX_NUM_SEQS = 64


@dataclass(frozen=True)
class BuiltEngine:
    engine: Engine
    # Keys to put under the worker's lease beside its instance record.
    lease_keys: dict[str, bytes] = field(default_factory=dict)


def build_engine(config: EngineConfig, instance_id: str, store: KeyValueStore, namespace: str, *,
                 kv_events: bool) -> BuiltEngine:
    """`kv_events`: whether the worker publishes KV events (`--kv-events`). The mocker emits them
    to whatever sink the worker sets (none when off); vLLM publishes them only when asked to, so
    without them it gets no publisher and the worker no listener."""
    if config.engine == "mocker":
        return _mocker(config, instance_id, store, namespace)
    return BuiltEngine(_vllm(config, kv_events))


def _mocker(config: EngineConfig, instance_id: str, store: KeyValueStore, namespace: str) -> BuiltEngine:
    endpoint = None
    lease_keys: dict[str, bytes] = {}
    if config.kv_transfer == "nixl":
        endpoint = NixlKvEndpoint(instance_id, config.kv_bytes_per_token,
                                  metadata_lookup=lambda peer: store.get(nixl_metadata_key(namespace, peer)))
        lease_keys[nixl_metadata_key(namespace, instance_id)] = endpoint.metadata()
    engine = MockerEngine(
        MockerConfig(
            model_dir=config.model.model_dir,
            served_model_name=config.served_model_name,
            block_size=config.block_size,
            num_gpu_blocks=config.num_gpu_blocks,
            max_num_seqs=config.max_num_seqs or MOCKER_MAX_NUM_SEQS,
            max_model_len=config.max_model_len,
            timing=TimingModel.of_profile(config.timing_profile or config.timing, config.speedup),
            kv_bytes_per_token=config.kv_bytes_per_token,
            answer_tokens=config.answer_tokens,
            host_kv_blocks=config.host_kv_blocks,
            host_kv_gbps=config.host_kv_gbps,
            lora=config.lora,
            session_pin_blocks=config.session_pin_blocks,
        ),
        kv_endpoint=endpoint,
    )
    return BuiltEngine(engine, lease_keys)


def _vllm(config: EngineConfig, kv_events: bool) -> Engine:
    from services.engines.vllm_encode import EncoderCacheShare
    from services.engines.vllm_engine import VllmConfig, VllmEngine, nixl_transfer_config

    # An encode worker's engine runs the image encoder only: no KV to move or report.
    kv_events = kv_events and not config.encodes
    return VllmEngine(
        VllmConfig(
            model_dir=config.model.model_dir,
            served_model_name=config.served_model_name,
            block_size=config.block_size,
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs or VLLM_MAX_NUM_SEQS,
            cpu_kv_cache_gib=int(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")),
            kv_connector=nixl_transfer_config(config.advertise_host, port_for_later())
            if config.kv_transfer == "nixl" and not config.encodes else None,
            host_kv_blocks=config.host_kv_blocks,
            kv_events=kv_events,
            lora=config.lora,
            kv_events_port=port_for_later() if kv_events else 0,
            encoder_cache=EncoderCacheShare(config.encoder_cache_dir, config.encodes)
            if config.encoder_cache_dir else None,
        )
    )
