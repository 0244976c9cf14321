"""An engine's LoRA adapters (services/engines/lora.py's AdapterSet): which it knows, which it
keeps loaded under --max-loras (least recently used unloaded, or a wait for a slot when every
one is busy), forgetting one while it runs, the errors, and the load rate it measures.

The loader is a recorder (AdapterLoader is our own interface) whose loads can be held open; the
adapters are real PEFT-shaped directories (a config with a rank, and a weights file of a chosen
size) in a temporary directory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from services.engines import lora
from services.engines.lora import (
    DEFAULT_LOAD_BYTES_PER_S,
    DEFAULT_LOAD_FIXED_S,
    LORA_OFF,
    Adapter,
    AdapterError,
    AdapterErrorKind,
    AdapterSet,
    LoraConfig,
    LoraModule,
)
from services.config_error import ConfigError
from services.profiles.cost_model import ADAPTER_LOAD_BASE_S, ADAPTER_LOAD_S_PER_GB
from tests.unit.adapter_engine import adapter_dir


class Recorder:
    """Records loads and unloads in order (by name and int_id); `gate` holds loads open when
    cleared; `advance` moves a fake clock by what a load of that size costs."""

    def __init__(self, advance: Callable[[Adapter], float] | None = None) -> None:
        self.log: list[tuple[str, str, int]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.now = 0.0
        self._advance = advance

    def clock(self) -> float:
        return self.now

    async def load(self, adapter: Adapter) -> None:
        await self.gate.wait()
        if self._advance is not None:
            self.now += self._advance(adapter)
        self.log.append(("load", adapter.name, adapter.int_id))

    async def unload(self, adapter: Adapter) -> None:
        self.log.append(("unload", adapter.name, adapter.int_id))


def adapter_set(tmp_path: Path, names: str = "abc", max_loras: int = 2,
                loader: Recorder | None = None) -> tuple[AdapterSet, Recorder]:
    loader = loader or Recorder()
    adapters = AdapterSet(LoraConfig(enabled=True, max_loras=max_loras), loader, clock=loader.clock)
    for name in names:
        adapters.register(name, adapter_dir(tmp_path, name))
    return adapters, loader


async def run_with(adapters: AdapterSet, name: str) -> None:
    async with adapters.use(name):
        pass


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_register_reads_the_rank_and_the_size_of_the_weights(tmp_path: Path) -> None:
    adapters, _ = adapter_set(tmp_path, "")
    adapter = adapters.register("sql", adapter_dir(tmp_path, "sql", size=12345, rank=4))
    assert (adapter.rank, adapter.size_bytes, adapter.int_id) == (4, 12345, 1)
    assert adapters.register("sql", adapter.path) is adapter  # the same path again: nothing changes
    (state,) = adapters.states()
    assert (state.name, state.resident, state.size_bytes, state.active_requests) == ("sql", False, 12345, 0)
    assert state.load_s == pytest.approx(DEFAULT_LOAD_FIXED_S + 12345 / DEFAULT_LOAD_BYTES_PER_S)


@pytest.mark.parametrize("setup, kind, message", [
    (lambda root: (root / "empty").mkdir() or str(root / "empty"), AdapterErrorKind.INVALID, "no adapter_config.json"),
    (lambda root: adapter_dir(root, "big", rank=32), AdapterErrorKind.INVALID, "above this worker's --max-lora-rank 16"),
    (lambda root: (root / "w").mkdir() or (root / "w" / "adapter_config.json").write_text('{"r": 8}') and str(root / "w"),
     AdapterErrorKind.INVALID, "no weights"),
    (lambda root: (root / "x").mkdir() or (root / "x" / "adapter_config.json").write_text('{"r": 0}') and str(root / "x"),
     AdapterErrorKind.INVALID, "no positive rank"),
])
def test_a_directory_that_is_no_usable_adapter_is_refused_saying_why(
        tmp_path: Path, setup: Callable[[Path], str], kind: AdapterErrorKind, message: str) -> None:
    adapters, _ = adapter_set(tmp_path, "")
    with pytest.raises(AdapterError, match=message) as caught:
        adapters.register("bad", setup(tmp_path))
    assert caught.value.kind is kind
    assert adapters.states() == []


def test_a_name_taken_by_another_path_an_unknown_name_and_lora_off_are_named_errors(tmp_path: Path) -> None:
    adapters, _ = adapter_set(tmp_path, "a")
    with pytest.raises(AdapterError, match="already loaded from") as caught:
        adapters.register("a", adapter_dir(tmp_path, "other"))
    assert caught.value.kind is AdapterErrorKind.CONFLICT
    with pytest.raises(AdapterError, match="'nope' is not known") as caught:
        adapters.get("nope")
    assert caught.value.kind is AdapterErrorKind.UNKNOWN
    off = AdapterSet(LORA_OFF, Recorder())
    for attempt in (lambda: off.register("a", adapter_dir(tmp_path, "a2")), lambda: off.get("a")):
        with pytest.raises(AdapterError, match="--enable-lora") as caught:
            attempt()
        assert caught.value.kind is AdapterErrorKind.DISABLED


def test_the_config_validates_itself() -> None:
    with pytest.raises(ConfigError, match="max-loras must be >= 1"):
        LoraConfig(enabled=True, max_loras=0)
    with pytest.raises(ConfigError, match="names an adapter twice"):
        LoraConfig(enabled=True, modules=(LoraModule("a", "/x"), LoraModule("a", "/y")))
    with pytest.raises(ConfigError, match="needs LoRA enabled"):
        LoraConfig(modules=(LoraModule("a", "/x"),))
    assert LoraModule.parse(" sql = /adapters/sql ") == LoraModule("sql", "/adapters/sql")
    with pytest.raises(ConfigError, match="NAME=PATH"):
        LoraModule.parse("sql")


async def test_a_request_loads_its_adapter_once_and_the_least_recently_used_goes_first(tmp_path: Path) -> None:
    adapters, loader = adapter_set(tmp_path, "abc", max_loras=2)
    for name in "aba":  # a is the most recently used now
        await run_with(adapters, name)
    assert loader.log == [("load", "a", 1), ("load", "b", 2)]
    await run_with(adapters, "c")
    assert loader.log[2:] == [("unload", "b", 2), ("load", "c", 3)]
    assert {s.name for s in adapters.states() if s.resident} == {"a", "c"}
    assert adapters.is_resident("a") and not adapters.is_resident("b")
    assert adapters.state(adapters.get("b")).load_s > 0 and adapters.state(adapters.get("a")).load_s == 0
    stats = adapters.stats
    assert (stats["a"].requests, stats["a"].loads, stats["a"].unloads) == (2, 1, 0)
    assert (stats["b"].requests, stats["b"].loads, stats["b"].unloads) == (1, 1, 1)


async def test_with_every_slot_busy_a_request_waits_for_one_and_nothing_busy_is_unloaded(tmp_path: Path) -> None:
    adapters, loader = adapter_set(tmp_path, "ab", max_loras=1)
    leave_a = asyncio.Event()

    async def hold_a() -> None:
        async with adapters.use("a"):
            assert adapters.state(adapters.get("a")).active_requests == 1
            await leave_a.wait()

    holder = asyncio.create_task(hold_a())
    await settle()
    waiter = asyncio.create_task(run_with(adapters, "b"))
    await settle()
    assert not waiter.done() and loader.log == [("load", "a", 1)]
    leave_a.set()
    await asyncio.wait_for(asyncio.gather(holder, waiter), 5)
    assert loader.log == [("load", "a", 1), ("unload", "a", 1), ("load", "b", 2)]


async def test_requests_of_a_resident_adapter_share_its_slot(tmp_path: Path) -> None:
    adapters, loader = adapter_set(tmp_path, "a", max_loras=1)
    leave = asyncio.Event()

    async def hold() -> None:
        async with adapters.use("a"):
            await leave.wait()

    tasks = [asyncio.create_task(hold()) for _ in range(3)]
    await settle()
    assert adapters.state(adapters.get("a")).active_requests == 3
    leave.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert loader.log == [("load", "a", 1)] and adapters.state(adapters.get("a")).active_requests == 0


async def test_an_adapter_forgotten_while_in_use_is_unloaded_when_its_last_request_ends(tmp_path: Path) -> None:
    adapters, loader = adapter_set(tmp_path, "ab", max_loras=2)
    await run_with(adapters, "b")
    leave = asyncio.Event()

    async def hold_a() -> None:
        async with adapters.use("a"):
            await leave.wait()

    holder = asyncio.create_task(hold_a())
    await settle()
    await adapters.unregister("a")
    assert ("unload", "a", 1) not in loader.log  # still running
    with pytest.raises(AdapterError) as caught:
        adapters.get("a")
    assert caught.value.kind is AdapterErrorKind.UNKNOWN
    assert [s.name for s in adapters.states()] == ["b"]
    leave.set()
    await asyncio.wait_for(holder, 5)
    assert loader.log[-1] == ("unload", "a", 1)
    await adapters.unregister("b")  # idle: unloaded at once
    assert loader.log[-1] == ("unload", "b", 2)


async def test_a_name_registered_again_from_another_path_is_loaded_as_another_adapter(tmp_path: Path) -> None:
    adapters, loader = adapter_set(tmp_path, "a", max_loras=2)
    leave = asyncio.Event()

    async def hold_old() -> None:
        async with adapters.use("a"):
            await leave.wait()

    holder = asyncio.create_task(hold_old())
    await settle()
    await adapters.unregister("a")
    new = adapters.register("a", adapter_dir(tmp_path, "a-v2"))
    assert not adapters.is_resident("a")  # the resident one is the old adapter's weights
    await run_with(adapters, "a")
    assert loader.log == [("load", "a", 1), ("load", "a", new.int_id)]
    leave.set()
    await asyncio.wait_for(holder, 5)
    assert loader.log[-1] == ("unload", "a", 1)
    assert adapters.is_resident("a")


async def test_a_request_cancelled_while_its_release_waits_on_a_load_still_frees_its_slot(tmp_path: Path) -> None:
    adapters, loader = adapter_set(tmp_path, "abc", max_loras=2)
    in_a, leave_a = asyncio.Event(), asyncio.Event()

    async def hold_a() -> None:
        async with adapters.use("a"):
            in_a.set()
            await leave_a.wait()

    holder = asyncio.create_task(hold_a())
    await in_a.wait()
    loader.gate.clear()  # b's load holds the set's lock until the gate opens
    loading_b = asyncio.create_task(run_with(adapters, "b"))
    await settle()
    leave_a.set()
    await settle()  # a's release now waits for the lock
    holder.cancel()
    await asyncio.gather(holder, return_exceptions=True)
    loader.gate.set()
    await asyncio.wait_for(loading_b, 5)
    assert adapters.state(adapters.get("a")).active_requests == 0
    await asyncio.wait_for(run_with(adapters, "c"), 5)  # a is idle, so it can make room
    assert ("unload", "a", 1) in loader.log


async def test_a_cancelled_wait_for_a_slot_takes_nothing(tmp_path: Path) -> None:
    adapters, loader = adapter_set(tmp_path, "ab", max_loras=1)
    leave = asyncio.Event()

    async def hold_a() -> None:
        async with adapters.use("a"):
            await leave.wait()

    holder = asyncio.create_task(hold_a())
    await settle()
    waiter = asyncio.create_task(run_with(adapters, "b"))
    await settle()
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    leave.set()
    await asyncio.wait_for(holder, 5)
    assert loader.log == [("load", "a", 1)] and adapters.stats["b"].requests == 0


async def test_the_expected_load_time_fits_the_fixed_part_and_the_rate_of_the_measured_loads(tmp_path: Path) -> None:
    fixed_s, s_per_byte = 0.15, 1e-6  # an engine round trip of 150 ms and a slow disk: 1 MB/s
    loader = Recorder(advance=lambda a: fixed_s + a.size_bytes * s_per_byte)
    adapters, _ = adapter_set(tmp_path, "", max_loras=2, loader=loader)
    small = adapters.register("small", adapter_dir(tmp_path, "small", size=10_000))
    large = adapters.register("large", adapter_dir(tmp_path, "large", size=40_000))
    huge = adapters.register("huge", adapter_dir(tmp_path, "huge", size=4_000_000))
    assert adapters.expected_load_s(large) == pytest.approx(DEFAULT_LOAD_FIXED_S + 40_000 / DEFAULT_LOAD_BYTES_PER_S)
    await run_with(adapters, "small")
    assert adapters.stats["small"].load_seconds == pytest.approx(fixed_s + 0.01)
    # Loads of one size: the rate keeps its default and the fixed part takes the rest, so a
    # large adapter is not taken to cost the small one's engine round trip per byte.
    assert adapters.expected_load_s(huge) == pytest.approx(fixed_s + 0.01 - 10_000 / DEFAULT_LOAD_BYTES_PER_S
                                                           + 4_000_000 / DEFAULT_LOAD_BYTES_PER_S)
    assert adapters.state(small).load_s == 0  # resident: nothing to load
    await run_with(adapters, "large")
    # Two sizes: both parts fitted exactly.
    assert adapters.load_times.fixed_s == pytest.approx(fixed_s)
    assert adapters.expected_load_s(huge) == pytest.approx(fixed_s + 4_000_000 * s_per_byte)


async def test_a_request_waits_for_a_busy_slot_no_longer_than_its_bound(tmp_path: Path) -> None:
    loader = Recorder()
    adapters = AdapterSet(LoraConfig(enabled=True, max_loras=1), loader, slot_wait_s=0.2)
    for name in "ab":
        adapters.register(name, adapter_dir(tmp_path, name))
    leave = asyncio.Event()

    async def hold_a() -> None:
        async with adapters.use("a"):
            await leave.wait()

    holder = asyncio.create_task(hold_a())
    await settle()
    with pytest.raises(AdapterError) as refused:
        await asyncio.wait_for(run_with(adapters, "b"), 5)
    assert refused.value.kind is AdapterErrorKind.BUSY
    assert not adapters.is_resident("b") and adapters.state(adapters.get("b")).active_requests == 0
    leave.set()
    await asyncio.wait_for(holder, 5)
    await asyncio.wait_for(run_with(adapters, "b"), 5)  # a slot freed: b loads
    assert adapters.is_resident("b")


def test_the_profiles_default_adapter_load_is_the_one_expected_before_any_was_measured() -> None:
    assert ADAPTER_LOAD_BASE_S == DEFAULT_LOAD_FIXED_S
    assert ADAPTER_LOAD_S_PER_GB == pytest.approx(1e9 / DEFAULT_LOAD_BYTES_PER_S)


async def test_a_forgotten_adapters_counters_stay_until_too_many_were_forgotten(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lora, "MAX_FORGOTTEN_STATS", 2)
    adapters, _ = adapter_set(tmp_path, "abcd", max_loras=2)
    await run_with(adapters, "a")
    await adapters.unregister("a")
    assert adapters.stats["a"].requests == 1 and adapters.stats["a"].unloads == 1  # readable after the unload
    for name in "bc":
        await adapters.unregister(name)
    assert set(adapters.stats) == {"b", "c", "d"}  # a, the oldest forgotten, left; d is known
