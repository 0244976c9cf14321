"""LoRA adapters on a vLLM engine: its engine arguments, how an adapter is loaded into it, and the
`LoRARequest` a request runs with.

The engine's `AdapterSet` (lora.py) decides which adapters are resident; vLLM's own adapter cache
is sized to agree with it (`max_cpu_loras` = `max_loras`), so vLLM never evicts an adapter the
set still counts as loaded, and the set unloads one (`remove_lora`) before it loads another.
vLLM's prefix cache keys every block of a request with an adapter by the adapter's name and path,
so adapters never share cached KV with each other or with the base model inside the engine; the
KV events say which adapter stored a block (vllm_kv_events.py).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from services.config_error import ConfigError
from services.engines.lora import Adapter, AdapterError, AdapterErrorKind, AdapterSet, LoraConfig

log = logging.getLogger(__name__)

# The adapter ranks vLLM 0.32 sizes its LoRA buffers for (its `MaxLoRARanks`).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts that holds every adapter of rank <= `rank` (the worker's
    --max-lora-rank stays the limit it checks adapters against)."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ConfigError(f"--max-lora-rank {rank}: vLLM supports ranks up to {VLLM_LORA_RANKS[-1]}")


def lora_engine_args(config: LoraConfig) -> dict[str, Any]:
    """vLLM's engine arguments for `config` (none when LoRA is off)."""
    if not config.enabled:
        return {}
    return dict(enable_lora=True, max_loras=config.max_loras, max_lora_rank=vllm_max_lora_rank(config.max_lora_rank),
                # vLLM's host-side adapter cache holds exactly the resident ones: the AdapterSet's LRU
                # is the only one that evicts.
                max_cpu_loras=config.max_loras)


def lora_request(adapter: Adapter) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(adapter.name, adapter.int_id, adapter.path)


class VllmAdapterLoader:
    """Loads and unloads adapters through a started `AsyncLLM` (`llm()` returns it)."""

    def __init__(self, llm: Callable[[], Any]) -> None:
        self._llm = llm

    async def load(self, adapter: Adapter) -> None:
        llm = self._running()
        try:
            loaded = await llm.add_lora(lora_request(adapter))
        except Exception as exc:  # noqa: BLE001 - vLLM reports a bad adapter with whatever its loader raised
            raise AdapterError(AdapterErrorKind.INVALID,
                               f"vLLM could not load the LoRA adapter {adapter.name!r} from {adapter.path}: {exc}") from exc
        if not loaded:
            raise AdapterError(AdapterErrorKind.INVALID,
                               f"vLLM refused the LoRA adapter {adapter.name!r} from {adapter.path}")

    async def unload(self, adapter: Adapter) -> None:
        llm = self._llm()
        if llm is None:  # stopped: nothing is loaded any more
            return
        if not await llm.remove_lora(adapter.int_id):
            # Not in vLLM's cache (never reached it, or it evicted it itself): nothing to free.
            log.info("LoRA adapter %s was not loaded in vLLM", adapter.name)

    def _running(self) -> Any:
        llm = self._llm()
        if llm is None:
            raise RuntimeError("vLLM engine is not started")
        return llm


def vllm_adapters(config: LoraConfig, llm: Callable[[], Any]) -> AdapterSet | None:
    """The engine's adapters, with the ones named at start (--lora-modules) registered: None
    when LoRA is off. A module that is not a usable adapter fails the start here."""
    if not config.enabled:
        return None
    adapters = AdapterSet(config, VllmAdapterLoader(llm))
    for module in config.modules:
        adapters.register(module.name, module.path)
    return adapters


@asynccontextmanager
async def held_lora(adapters: AdapterSet | None, name: str) -> AsyncIterator[Any]:
    """The `LoRARequest` of adapter `name`, resident and held while the block runs; None for the
    base model (""). Raises AdapterError: DISABLED without LoRA, UNKNOWN for a name not known."""
    if not name:
        yield None
        return
    if adapters is None:
        raise AdapterError(AdapterErrorKind.DISABLED,
                           f"adapter {name!r}: this worker was started without LoRA (--enable-lora)")
    async with adapters.use(name) as adapter:
        yield lora_request(adapter)


async def preload(adapters: AdapterSet | None) -> None:
    """Makes the adapters named at start resident, up to --max-loras of them, so their first
    requests pay no load (and the router sees them resident from the start)."""
    if adapters is None:
        return
    for state in adapters.states()[: adapters.config.max_loras]:
        await adapters.make_resident(adapters.get(state.name))
