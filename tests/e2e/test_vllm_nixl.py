"""On a CPU host the NIXL connector's agent is built without NIXL's progress thread (it spun a
core per idle engine), and the worker names the connector module that does it.

Marked `vllm`; in e2e, since importing vLLM's NIXL support starts a process (`file`) to probe the platform."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


def test_the_agent_config_vllm_builds_leaves_the_progress_thread_off() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    from services.engines.vllm_nixl import agents_without_progress_thread

    assert base_worker.nixl_agent_config(num_threads=4).enable_pthread  # NIXL's default: on
    with agents_without_progress_thread():
        # As vLLM's worker calls it while it builds the agent.
        config = base_worker.nixl_agent_config(num_threads=4, capture_telemetry=True)
    assert config.enable_pthread is False and config.num_threads == 4 and config.capture_telemetry
    assert base_worker.nixl_agent_config(num_threads=4).enable_pthread  # put back afterwards


def test_the_cpu_transfer_config_names_the_quiet_connector_under_vllms_name() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.config import KVTransferConfig

    from services.engines.vllm_engine import nixl_transfer_config
    from services.engines.vllm_nixl import NixlConnector

    config = nixl_transfer_config("127.0.0.1", 5600)
    assert config["kv_connector"] == "NixlConnector" and config["kv_buffer_device"] == "cpu"
    assert KVConnectorFactory.get_connector_class(KVTransferConfig(**config)) is NixlConnector
