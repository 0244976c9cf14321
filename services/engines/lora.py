"""LoRA adapters on one engine: which it knows, which are loaded, and what loading one costs.

An engine keeps at most `max_loras` adapters loaded (resident). A request names an adapter the
engine knows; `AdapterSet.use` makes it resident first, unloading the least recently used
adapter that no running request holds, or waiting until one is free when all slots are busy
(as vLLM's scheduler holds back a request whose adapter finds no slot). The engine itself only
says how an adapter is loaded and unloaded (`AdapterLoader`): vLLM through its LoRA support, the
mocker by waiting the time its timing model gives.

Load times are measured: `expected_load_s` fits a fixed part and seconds per byte to the recent
loads (`LoadTimes`) and applies them to an adapter's size, which is what workers report and the
router weighs.

A request waits at most `slot_wait_s` for a slot (every resident adapter held by running
requests): past it, AdapterError(BUSY), a 503 the client may retry, rather than a request stuck
behind others that may keep their adapters busy for good.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from services.config_error import ConfigError

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
# What a load costs before any was measured: a fixed part and a transfer rate (a local disk
# read into host memory, then a copy to the device).
DEFAULT_LOAD_FIXED_S = 0.02
DEFAULT_LOAD_BYTES_PER_S = 2e9
# Forgotten adapters whose counters are kept (the most recently forgotten).
MAX_FORGOTTEN_STATS = 256
# The loads the fit of the load time keeps (the most recent).
LOAD_SAMPLES = 16
# The longest a request waits for an adapter slot to free (see the module docstring).
SLOT_WAIT_S = 30.0
# What counts as an adapter's weights (PEFT writes adapter_model.safetensors or .bin): the size
# a load is timed by.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


class AdapterErrorKind(enum.StrEnum):
    """Why an adapter request was refused; each maps to one gRPC status and one HTTP status."""

    DISABLED = "lora_disabled"  # the worker was started without LoRA
    UNKNOWN = "unknown_adapter"  # no adapter of that name
    INVALID = "invalid_adapter"  # the path is not an adapter this engine can use
    CONFLICT = "adapter_conflict"  # the name is taken by another path
    BUSY = "adapter_slots_busy"  # every slot held by running requests for longer than slot_wait_s


class AdapterError(Exception):
    def __init__(self, kind: AdapterErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class LoraModule:
    """An adapter named at start (`--lora-modules NAME=PATH`) or loaded at run time."""

    name: str
    path: str

    @classmethod
    def parse(cls, text: str) -> LoraModule:
        name, sep, path = text.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ConfigError(f"--lora-modules takes NAME=PATH, got {text!r}")
        return cls(name.strip(), path.strip())


@dataclass(frozen=True)
class LoraConfig:
    """A worker's LoRA settings (`--enable-lora`, `--lora-modules`, `--max-loras`, `--max-lora-rank`)."""

    enabled: bool = False
    modules: tuple[LoraModule, ...] = ()
    max_loras: int = 4
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ConfigError(f"--max-loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ConfigError(f"--max-lora-rank must be >= 1, got {self.max_lora_rank}")
        names = [m.name for m in self.modules]
        if len(set(names)) != len(names):
            raise ConfigError(f"--lora-modules names an adapter twice: {sorted(names)}")
        if self.modules and not self.enabled:
            raise ConfigError("--lora-modules needs LoRA enabled (--enable-lora)")


LORA_OFF = LoraConfig()


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    path: str
    size_bytes: int
    rank: int
    # A small positive integer unique within the engine (vLLM's `lora_int_id`).
    int_id: int


@dataclass(frozen=True, slots=True)
class AdapterState:
    """What a worker reports of one adapter (worker.proto's LoraAdapterState)."""

    name: str
    path: str
    resident: bool
    size_bytes: int
    load_s: float
    active_requests: int


@dataclass(slots=True)
class AdapterStats:
    """Counters per adapter, for the worker's metrics (never reset; an unloaded adapter keeps them)."""

    requests: int = 0
    loads: int = 0
    unloads: int = 0
    load_seconds: float = 0.0


class AdapterLoader(Protocol):
    """How one engine puts an adapter in and out of its memory."""

    async def load(self, adapter: Adapter) -> None: ...

    async def unload(self, adapter: Adapter) -> None: ...


def read_adapter(name: str, path: str, max_rank: int, int_id: int) -> Adapter:
    """The adapter at `path` (a PEFT directory), checked: its config names a rank within the
    engine's `max_lora_rank`, and it has weights. Raises AdapterError(INVALID) saying what is wrong."""
    root = Path(path)
    config_file = root / ADAPTER_CONFIG
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise AdapterError(AdapterErrorKind.INVALID, f"adapter {name!r}: no {ADAPTER_CONFIG} in {path}") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(AdapterErrorKind.INVALID, f"adapter {name!r}: cannot read {config_file}: {exc}") from None
    rank = config.get("r") if isinstance(config, dict) else None
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(AdapterErrorKind.INVALID, f"adapter {name!r}: {config_file} has no positive rank `r`")
    if rank > max_rank:
        raise AdapterError(AdapterErrorKind.INVALID,
                           f"adapter {name!r} has rank {rank}, above this worker's --max-lora-rank {max_rank}")
    weights = [p for p in root.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES]
    if not weights:
        raise AdapterError(AdapterErrorKind.INVALID,
                           f"adapter {name!r}: no weights ({', '.join('*' + s for s in WEIGHT_SUFFIXES)}) in {path}")
    return Adapter(name, str(root), sum(p.stat().st_size for p in weights), rank, int_id)


class LoadTimes:
    """Seconds a load takes, from the recent ones: `fixed + size * per_byte`, least squares over
    the last LOAD_SAMPLES loads when they span two sizes or more; loads of one size tell the two
    parts apart no better than the defaults do, so the rate keeps its default and the fixed part
    takes the rest. Before any load, the defaults."""

    def __init__(self) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=LOAD_SAMPLES)
        self.fixed_s = DEFAULT_LOAD_FIXED_S
        self.s_per_byte = 1 / DEFAULT_LOAD_BYTES_PER_S

    def add(self, size_bytes: int, seconds: float) -> None:
        self._samples.append((size_bytes, seconds))
        sizes = [float(size) for size, _ in self._samples]
        times = [t for _, t in self._samples]
        n = len(sizes)
        mean_size, mean_time = sum(sizes) / n, sum(times) / n
        spread = sum((x - mean_size) ** 2 for x in sizes)
        if spread > 0:
            slope = sum((x - mean_size) * (t - mean_time) for x, t in zip(sizes, times)) / spread
            self.s_per_byte = max(0.0, slope)
        else:
            self.s_per_byte = 1 / DEFAULT_LOAD_BYTES_PER_S
        self.fixed_s = max(0.0, mean_time - self.s_per_byte * mean_size)

    def expected(self, size_bytes: int) -> float:
        return self.fixed_s + size_bytes * self.s_per_byte


@dataclass
class _Slots:
    """The resident adapters, least recently used first, and the requests holding each, by
    `int_id`: a name forgotten while in use and registered again from another path is another
    adapter, loaded on its own, while the old one waits for its last request to be unloaded."""

    resident: OrderedDict[int, Adapter] = field(default_factory=OrderedDict)
    active: dict[int, int] = field(default_factory=dict)


class AdapterSet:
    """The adapters one engine knows and keeps loaded (see the module docstring)."""

    def __init__(self, config: LoraConfig, loader: AdapterLoader,
                 clock: Callable[[], float] = time.monotonic, slot_wait_s: float = SLOT_WAIT_S) -> None:
        self.config = config
        self._loader = loader
        self._clock = clock
        self._known: dict[str, Adapter] = {}
        self._slots = _Slots()
        self._next_id = 1
        # Guards the slots; loads and unloads run under it, one at a time, as an engine's own
        # adapter loading blocks its step (vLLM loads an adapter while it sets up a batch).
        self._changed = asyncio.Condition()
        self._slot_wait_s = slot_wait_s
        self.load_times = LoadTimes()
        # Per adapter, known or forgotten; the oldest forgotten leave past MAX_FORGOTTEN_STATS, so
        # the metrics' labels stay bounded while an unloaded adapter's counters stay readable.
        self.stats: dict[str, AdapterStats] = {}
        self._forgotten: OrderedDict[str, None] = OrderedDict()

    # --- what the engine knows -------------------------------------------------------------

    def register(self, name: str, path: str) -> Adapter:
        """Makes the adapter known (loaded on its first request). Idempotent for the same path."""
        if not self.config.enabled:
            raise AdapterError(AdapterErrorKind.DISABLED, "this worker was started without LoRA (--enable-lora)")
        known = self._known.get(name)
        if known is not None:
            if Path(known.path) == Path(path):
                return known
            raise AdapterError(AdapterErrorKind.CONFLICT, f"adapter {name!r} is already loaded from {known.path}")
        adapter = read_adapter(name, path, self.config.max_lora_rank, self._next_id)
        self._next_id += 1
        self._known[name] = adapter
        self._forgotten.pop(name, None)
        self.stats.setdefault(name, AdapterStats())
        log.info("LoRA adapter %s known (%s, rank %d, %d bytes)", name, path, adapter.rank, adapter.size_bytes)
        return adapter

    async def unregister(self, name: str) -> Adapter:
        """Forgets the adapter; it is unloaded now, or when its last running request ends."""
        adapter = self.get(name)
        del self._known[name]
        self._forget_stats(name)
        async with self._changed:
            if self._slots.active.get(adapter.int_id, 0) == 0 and adapter.int_id in self._slots.resident:
                await self._unload(adapter)
            self._changed.notify_all()
        log.info("LoRA adapter %s forgotten", name)
        return adapter

    def _forget_stats(self, name: str) -> None:
        self._forgotten[name] = None
        while len(self._forgotten) > MAX_FORGOTTEN_STATS:
            oldest, _ = self._forgotten.popitem(last=False)
            self.stats.pop(oldest, None)

    def get(self, name: str) -> Adapter:
        adapter = self._known.get(name)
        if adapter is None:
            if not self.config.enabled:
                raise AdapterError(AdapterErrorKind.DISABLED,
                                   f"adapter {name!r}: this worker was started without LoRA (--enable-lora)")
            raise AdapterError(AdapterErrorKind.UNKNOWN, f"the LoRA adapter {name!r} is not known to this worker")
        return adapter

    def states(self) -> list[AdapterState]:
        return [self.state(a) for a in self._known.values()]

    def state(self, adapter: Adapter) -> AdapterState:
        resident = adapter.int_id in self._slots.resident
        return AdapterState(adapter.name, adapter.path, resident, adapter.size_bytes,
                            0.0 if resident else self.expected_load_s(adapter),
                            self._slots.active.get(adapter.int_id, 0))

    def is_resident(self, name: str) -> bool:
        adapter = self._known.get(name)
        return adapter is not None and adapter.int_id in self._slots.resident

    def expected_load_s(self, adapter: Adapter) -> float:
        return self.load_times.expected(adapter.size_bytes)

    # --- running requests ------------------------------------------------------------------

    @asynccontextmanager
    async def use(self, name: str) -> AsyncIterator[Adapter]:
        """Holds adapter `name` resident while the caller's request runs with it."""
        adapter = self.get(name)
        await self.make_resident(adapter, hold=True)
        self.stats.setdefault(name, AdapterStats()).requests += 1
        try:
            yield adapter
        finally:
            await self._release(adapter)

    async def make_resident(self, adapter: Adapter, hold: bool = False) -> None:
        """Loads `adapter` unless resident (unloading the least recently used idle one when the
        slots are full, or waiting up to `slot_wait_s` for one to become idle: AdapterError(BUSY)
        past it); with `hold`, counts a request on it in the same step, so no other load can
        unload it in between. A resident adapter takes no lock: another's load does not delay it."""
        key = adapter.int_id
        if key in self._slots.resident:
            self._hold(key, hold)
            return
        deadline = self._clock() + self._slot_wait_s
        async with self._changed:
            while key not in self._slots.resident and len(self._slots.resident) >= self.config.max_loras:
                victim = self._idle_victim()
                if victim is not None:
                    await self._unload(victim)
                    break
                await self._wait_for_slot(adapter, deadline)
            if key not in self._slots.resident:
                # Shielded: a caller cancelled mid-load must not leave the engine holding an
                # adapter this set does not count (vLLM would then evict by its own LRU).
                await asyncio.shield(self._load(adapter))
            self._hold(key, hold)

    def _hold(self, key: int, hold: bool) -> None:
        self._slots.resident.move_to_end(key)
        if hold:
            self._slots.active[key] = self._slots.active.get(key, 0) + 1

    async def _wait_for_slot(self, adapter: Adapter, deadline: float) -> None:
        left = deadline - self._clock()
        try:
            if left <= 0:
                raise TimeoutError
            await asyncio.wait_for(self._changed.wait(), left)
        except TimeoutError:
            raise AdapterError(AdapterErrorKind.BUSY,
                               f"LoRA adapter {adapter.name!r}: all {self.config.max_loras} adapter slots of this worker "
                               f"stayed busy for {self._slot_wait_s:.0f}s") from None

    async def _release(self, adapter: Adapter) -> None:
        # Counted off at once, not after waiting for the lock (a load may hold it): a request
        # cancelled while it waited would otherwise hold its slot for good. The rest is shielded
        # for the same reason: a slot waiter must hear of it.
        key = adapter.int_id
        left = self._slots.active.get(key, 0) - 1
        if left > 0:
            self._slots.active[key] = left
        else:
            self._slots.active.pop(key, None)
        await asyncio.shield(self._after_release(adapter))

    async def _after_release(self, adapter: Adapter) -> None:
        async with self._changed:
            idle = adapter.int_id not in self._slots.active
            if idle and self._known.get(adapter.name) is not adapter and adapter.int_id in self._slots.resident:
                await self._unload(adapter)  # forgotten (or replaced) while it ran
            self._changed.notify_all()

    def _idle_victim(self) -> Adapter | None:
        for key, adapter in self._slots.resident.items():  # least recently used first
            if self._slots.active.get(key, 0) == 0:
                return adapter
        return None

    async def _load(self, adapter: Adapter) -> None:
        started = self._clock()
        await self._loader.load(adapter)
        took = self._clock() - started
        self._slots.resident[adapter.int_id] = adapter
        stats = self.stats.setdefault(adapter.name, AdapterStats())
        stats.loads += 1
        stats.load_seconds += took
        self.load_times.add(adapter.size_bytes, took)
        log.info("LoRA adapter %s loaded in %.3fs (%d resident of %d)", adapter.name, took,
                 len(self._slots.resident), self.config.max_loras)

    async def _unload(self, adapter: Adapter) -> None:
        # Out of the slots before the engine is told: a request arriving meanwhile must not take
        # it as resident (the fast path in make_resident takes no lock).
        self._slots.resident.pop(adapter.int_id, None)
        await self._loader.unload(adapter)
        self.stats.setdefault(adapter.name, AdapterStats()).unloads += 1
        log.info("LoRA adapter %s unloaded", adapter.name)
