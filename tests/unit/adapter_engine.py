"""An engine stand-in with a real AdapterSet, for tests of the worker's LoRA adapters: its loader
loads instantly and records what it was asked, and each request generates one token."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path

from services.engines.base import Engine, EngineInfo, EngineOutput, EngineRequest, FinishReason, LoadSnapshot, RowTap
from services.engines.lora import Adapter, AdapterSet, LoraConfig
from services.tools.make_demo_adapter import write_stand_in_adapter


def adapter_dir(root: Path, name: str, rank: int = 8, size: int = 4096) -> str:
    """Adapter `name` under `root`, with no weights in it (write_stand_in_adapter): its path."""
    return str(write_stand_in_adapter(root / name, size, rank))


@dataclass
class LoaderLog:
    """An AdapterLoader that loads instantly and remembers what it was asked."""

    calls: list[tuple[str, str]] = field(default_factory=list)

    async def load(self, adapter: Adapter) -> None:
        self.calls.append(("load", adapter.name))

    async def unload(self, adapter: Adapter) -> None:
        self.calls.append(("unload", adapter.name))


class AdapterEngine(Engine):
    """Generates one token per request, holding the request's adapter while it runs (as engines do)."""

    name = "stand-in"
    info = EngineInfo("", "base", 16, 4096, 1000)

    def __init__(self, lora: LoraConfig | None) -> None:
        self.loader = LoaderLog()
        self.adapters = AdapterSet(lora, self.loader) if lora is not None else None
        self.requests: list[EngineRequest] = []

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def check_health(self) -> None: ...

    def load(self) -> LoadSnapshot:
        return LoadSnapshot(request_total_slots=8)

    async def generate(self, request: EngineRequest, tap: RowTap | None = None) -> AsyncGenerator[EngineOutput, None]:
        self.requests.append(request)
        if request.lora_name:
            assert self.adapters is not None
            async with self.adapters.use(request.lora_name):
                yield EngineOutput([7], FinishReason.LENGTH)
        else:
            yield EngineOutput([7], FinishReason.LENGTH)
