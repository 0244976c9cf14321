"""vLLM's NIXL connector on a CPU host, without NIXL's progress thread.

NIXL 1.5's agent starts a UCX progress thread polling with a zero timeout (vLLM cannot set its
delay), so every idle CPU engine with the connector kept one core at 100% (seen: the
`VLLM::Worker` process of each prefill and decode worker, in `nixlUcxSharedThread::run`). On a
GPU host that is one core of many; on a laptop or a 2-core CI machine two idle workers took
every core, and anything else sharing the host starved (a plain vLLM beside a disaggregated
mesh took 400 s instead of 27 s). vLLM does not need the thread: it checks its transfers and
notifications from its own step loop, and each check progresses UCX.

vLLM loads this module in its engine processes when the worker names it in
`kv_connector_module_path` (vllm_engine.nixl_transfer_config); the class keeps the name
`NixlConnector`, so every check vLLM makes by connector name still applies.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector


# Where vLLM's worker reads the agent's config from; a vLLM that moved it would leave the thread
# spinning again without a word, so a missing one stops the engine at its start instead.
if not hasattr(base_worker, "nixl_agent_config"):
    raise ImportError("vLLM's NIXL worker no longer reads nixl_agent_config: services/engines/vllm_nixl.py "
                      "cannot turn NIXL's progress thread off")


@contextmanager
def agents_without_progress_thread() -> Iterator[None]:
    """While the connector builds its NIXL agent, the agent's config leaves the thread off."""
    vllm_factory = base_worker.nixl_agent_config

    def quiet(**kwargs: Any) -> Any:
        # None: NIXL is missing, and vLLM's worker says so itself.
        return None if vllm_factory is None else vllm_factory(enable_prog_thread=False, **kwargs)

    base_worker.nixl_agent_config = quiet
    try:
        yield
    finally:
        base_worker.nixl_agent_config = vllm_factory


class NixlConnector(NixlPullConnector):
    """vLLM's pull connector (what `NixlConnector` names in vLLM), its agent built without a
    progress thread."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with agents_without_progress_thread():
            super().__init__(*args, **kwargs)
