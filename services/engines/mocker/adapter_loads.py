"""LoRA adapter loads in the mocker: simulated inside the engine's step, timed from the adapter's size.

vLLM loads an adapter while it sets up the batch that first needs it, so a load stalls that step
for every running request, not only for the one that asked. The mocker does the same: a load is
queued for the step loop, whose next step lasts the load time longer (the timing model's
`adapter_load_seconds`: the profile's `adapter_load_base_s` plus the adapter's bytes at
`adapter_load_s_per_gb`, divided by the speedup); the load returns when that step ends.
Unloading frees memory only, which costs nothing next to a step.

`clock` is what the AdapterSet measures loads with: the imitated machine's time (a load's time
without the speedup), the same scale `MockerEngine.load` reports its prefill cost on, since the
router weighs the two against each other and their ratio is the imitated machine's whatever the
speedup.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from services.engines.lora import Adapter
from services.engines.mocker.timing import TimingModel


@dataclass(frozen=True, slots=True)
class _Load:
    seconds: float
    done: asyncio.Future[None]


class SimulatedAdapterLoader:
    """The mocker's `AdapterLoader` (lora.py); `wake` starts the engine's step loop when idle."""

    def __init__(self, timing: TimingModel, wake: Callable[[], None]) -> None:
        self._timing = timing
        self._wake = wake
        self._queued: list[_Load] = []
        self._in_step: list[_Load] = []
        self._imitated_s = 0.0

    def clock(self) -> float:
        """Seconds the imitated machine has spent loading adapters so far."""
        return self._imitated_s

    async def load(self, adapter: Adapter) -> None:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queued.append(_Load(self._timing.adapter_load_seconds(adapter.size_bytes), done))
        self._wake()
        await done
        self._imitated_s += self._timing.cost.adapter_load_s(adapter.size_bytes)

    async def unload(self, adapter: Adapter) -> None:
        """Nothing to wait for: dropping weights is free next to a step."""

    @property
    def queued(self) -> bool:
        return bool(self._queued)

    def start_step(self) -> float:
        """Takes the queued loads into the step that starts now; returns the seconds they add to it.
        A load whose caller gave up before its step started is dropped."""
        self._in_step = [load for load in self._queued if not load.done.done()]
        self._queued = []
        return sum(load.seconds for load in self._in_step)

    def end_step(self) -> None:
        """The step ended: its loads are done."""
        for load in self._in_step:
            if not load.done.done():
                load.done.set_result(None)
        self._in_step = []

    def abort(self, why: str) -> None:
        """The engine stopped: every load waiting on a step fails."""
        for load in self._in_step + self._queued:
            if not load.done.done():
                load.done.set_exception(RuntimeError(why))
        self._in_step, self._queued = [], []
