"""LoRA adapters on the mocker engine: tokens that depend on the adapter and stay exact, caches
kept apart (in the block manager, its KV events and the host tier), a load that stalls the
engine's step for everyone, --max-loras eviction, the errors, and a disaggregated hand-off that
names its adapter.

Engines are real MockerEngines on the demo model; adapters are real PEFT-shaped directories (a
config with a rank, a weights file of a chosen size) in a temporary directory.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest

from services.engines.base import EngineRequest, Sampling
from services.engines.lora import AdapterError, AdapterErrorKind, LoraConfig, LoraModule
from services.engines.mocker.block_manager import BlockManager
from services.engines.mocker.engine import MockerConfig, MockerEngine
from services.engines.mocker.kv_transfer import KvTransferError, check_pull_adapter
from services.engines.mocker.timing import TimingModel
from services.kv_protocol.events import KvEventData, KvRemoved, KvStored
from services.kv_protocol.hashing import KV_HASH_SEED, adapter_seed, chain_from, local_block_hashes
from services.kv_protocol.tier import Tier
from services.profiles.cost_model import CostModel
from services.profiles.profile_file import FORMAT, load_profile
from services.tools.make_demo_model import ensure_demo_model
from tests.unit.clocks import advance, until, virtual_time
from tests.unit.adapter_engine import adapter_dir

BS = 16
PROMPT = list(range(100, 164))  # 4 full blocks
ADAPTER_BYTES = 4_000_000


def engine(tmp_path: Path | None, names: str = "ab", max_loras: int = 2, speedup: float = float("inf"),
           cost: CostModel | None = None, num_blocks: int = 1024) -> MockerEngine:
    """A mocker serving adapters `names` (each a one-letter name), or without LoRA (tmp_path None)."""
    lora = LoraConfig() if tmp_path is None else LoraConfig(
        enabled=True, modules=tuple(LoraModule(n, adapter_dir(tmp_path, n, size=ADAPTER_BYTES)) for n in names),
        max_loras=max_loras)
    timing = TimingModel(cost or TimingModel().cost, speedup)
    return MockerEngine(MockerConfig(str(ensure_demo_model()), "demo", block_size=BS, num_gpu_blocks=num_blocks,
                                     timing=timing, lora=lora))


async def run(e: MockerEngine, rid: str, tokens: list[int], lora: str = "", max_tokens: int = 8,
              **fields) -> tuple[list[int], int]:
    out: list[int] = []
    cached = 0
    request = EngineRequest(rid, tokens, Sampling(max_tokens=max_tokens), lora_name=lora, **fields)
    async for o in e.generate(request):
        out += o.token_ids
        cached = o.cached_tokens
    return out, cached


async def test_each_adapter_has_its_own_tokens_and_repeats_them_exactly_on_any_worker(tmp_path: Path) -> None:
    one, two = engine(tmp_path), engine(tmp_path)
    await one.start()
    await two.start()
    try:
        outputs = {lora: (await run(one, f"r-{lora}", PROMPT, lora, 12))[0] for lora in ("", "a", "b")}
        assert len({tuple(tokens) for tokens in outputs.values()}) == 3
        for lora, tokens in outputs.items():
            assert (await run(two, f"again-{lora}", PROMPT, lora, 12))[0] == tokens
            assert (await run(one, f"cached-{lora}", PROMPT, lora, 5))[0] == tokens[:5]
        # The base model's tokens are those of a mocker started without LoRA.
        plain = engine(None)
        await plain.start()
        try:
            assert (await run(plain, "plain", PROMPT, "", 12))[0] == outputs[""]
        finally:
            await plain.stop()
    finally:
        await one.stop()
        await two.stop()


async def test_a_request_with_an_adapter_resumed_on_another_worker_continues_exactly(tmp_path: Path) -> None:
    one, two = engine(tmp_path), engine(tmp_path)
    await one.start()
    await two.start()
    try:
        whole, _ = await run(one, "r1", PROMPT, "a", 12)
        rest, _ = await run(two, "r1~1", PROMPT + whole[:5], "a", 7, resumed_tokens=5)
        assert whole[:5] + rest == whole
    finally:
        await one.stop()
        await two.stop()


async def test_an_adapter_never_reuses_the_base_models_or_another_adapters_cache(tmp_path: Path) -> None:
    e = engine(tmp_path)
    await e.start()
    try:
        assert (await run(e, "a1", PROMPT, "a"))[1] == 0
        assert (await run(e, "b1", PROMPT, "b"))[1] == 0  # only a has seen this prompt
        assert (await run(e, "base1", PROMPT, ""))[1] == 0
        assert (await run(e, "a2", PROMPT + [5, 6], "a"))[1] == 64
        assert (await run(e, "b2", PROMPT, "b"))[1] == 64
        assert (await run(e, "base2", PROMPT, ""))[1] == 64
    finally:
        await e.stop()


async def test_kv_events_name_the_adapter_and_carry_its_seeded_hashes(tmp_path: Path) -> None:
    e = engine(tmp_path)
    events: list[KvEventData] = []
    e.set_kv_event_sink(events.append)
    await e.start()
    try:
        # 64 prompt tokens and 20 more: the fifth block fills during decode.
        tokens, _ = await run(e, "a1", PROMPT, "a", max_tokens=20)
        await run(e, "base1", PROMPT, "", max_tokens=1)
    finally:
        await e.stop()
    stored = [ev for ev in events if isinstance(ev, KvStored)]
    assert [ev.lora_name for ev in stored] == ["a", "a", ""]
    seeded = local_block_hashes(PROMPT + tokens, BS, adapter_seed("a"))
    assert [local for ev in stored[:2] for _, local in ev.blocks] == seeded[:5]
    assert [h for ev in stored[:2] for h, _ in ev.blocks] == chain_from(seeded)[:5]
    base = local_block_hashes(PROMPT, BS, KV_HASH_SEED)
    assert [local for _, local in stored[2].blocks] == base
    assert not set(base) & set(seeded)


def test_the_host_tier_keeps_which_adapter_a_block_belongs_to() -> None:
    events: list[KvEventData] = []
    bm = BlockManager(2, 4, events.append, host_blocks=8)
    tokens = list(range(8))
    locals_a = local_block_hashes(tokens, 4, adapter_seed("a"))
    chain_a = chain_from(locals_a)
    bm.free(bm.allocate(chain_a, locals_a, 8, "a")[0])
    locals_base = local_block_hashes(tokens, 4)
    chain_base = chain_from(locals_base)
    assert bm.cached_prefix_blocks(chain_base) == 0 and bm.host_prefix_blocks(chain_base, 0) == 0
    bm.free(bm.allocate(chain_base, locals_base, 8)[0])  # evicts a's blocks to host memory
    to_host = [ev for ev in events if isinstance(ev, KvStored) and ev.tier is Tier.HOST]
    assert to_host == [KvStored(None, tuple(zip(chain_a, locals_a)), Tier.HOST, "a")]
    bm.allocate(chain_a, locals_a, 8, "a")  # loaded back: stored on the device under a again
    back = [ev for ev in events if isinstance(ev, KvStored)][-1]
    assert (back.tier, back.lora_name, back.blocks) == (Tier.DEVICE, "a", tuple(zip(chain_a, locals_a)))
    assert isinstance(events[-1], KvRemoved) and events[-1].tier is Tier.HOST


@virtual_time
async def test_a_cold_adapters_first_request_waits_its_load_time_and_the_next_does_not(tmp_path: Path) -> None:
    # A slow load (3 s on the imitated machine) at speedup 10: 0.3 s of the engine's (virtual) time.
    cost = replace(TimingModel().cost, adapter_load_base_s=3.0)
    e = engine(tmp_path, speedup=10, cost=cost)
    clock = asyncio.get_running_loop().time
    await e.start()
    try:
        started = clock()
        await run(e, "cold", PROMPT, "a", max_tokens=1)
        cold = clock() - started
        started = clock()
        await run(e, "warm", PROMPT, "a", max_tokens=1)
        warm = clock() - started
        # The load on top of a step (an uncached prompt's, longer than the warm one's cached step).
        assert cold - warm >= TimingModel(cost, 10).adapter_load_seconds(ADAPTER_BYTES) >= 0.3, (cold, warm)
        assert warm < 0.01, warm
        assert e.adapters is not None
        stats = e.adapters.stats["a"]
        # Measured on the imitated machine's clock, as the prefill cost is reported: no speedup.
        assert (stats.loads, stats.requests) == (1, 2)
        assert stats.load_seconds == pytest.approx(cost.adapter_load_s(ADAPTER_BYTES))
    finally:
        await e.stop()


@virtual_time
async def test_a_load_stalls_the_engines_step_for_every_running_request(tmp_path: Path) -> None:
    cost = replace(TimingModel().cost, adapter_load_base_s=0.4)
    e = engine(tmp_path, speedup=1, cost=cost)
    clock = asyncio.get_running_loop().time
    await e.start()
    try:
        stamps: list[float] = []

        async def base_stream() -> None:
            async for _ in e.generate(EngineRequest("base", PROMPT, Sampling(max_tokens=60))):
                stamps.append(clock())

        streaming = asyncio.create_task(base_stream())
        await until(lambda: len(stamps) >= 5)
        await run(e, "needs-a", PROMPT, "a", max_tokens=1)
        await asyncio.wait_for(streaming, 10)
        gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
        # Decode steps take ~12 ms; the step that loaded the adapter took the load time longer.
        assert gaps[-1] >= cost.adapter_load_s(ADAPTER_BYTES) >= 0.4 and gaps[-2] < 0.1, gaps
    finally:
        await e.stop()


async def test_max_loras_keeps_the_most_recently_used_adapters_resident(tmp_path: Path) -> None:
    e = engine(tmp_path, names="abc", max_loras=2)
    await e.start()
    try:
        assert e.adapters is not None
        for i, lora in enumerate("abac"):  # c evicts b, the least recently used
            await run(e, f"r{i}", PROMPT, lora, 1)
        assert {s.name for s in e.adapters.states() if s.resident} == {"a", "c"}
        await run(e, "r4", PROMPT, "b", 1)  # now a is the least recently used
        assert {s.name for s in e.adapters.states() if s.resident} == {"b", "c"}
        assert [e.adapters.stats[n].unloads for n in "abc"] == [1, 1, 0]
        assert [e.adapters.stats[n].loads for n in "abc"] == [1, 2, 1]
    finally:
        await e.stop()


@virtual_time
async def test_with_every_slot_busy_an_adapter_request_waits_for_one(tmp_path: Path) -> None:
    e = engine(tmp_path, max_loras=1, speedup=1)
    await e.start()
    try:
        long_a = asyncio.create_task(run(e, "long-a", PROMPT, "a", max_tokens=30))
        await until(lambda: e.adapters is not None and e.adapters.is_resident("a"))
        short_b = asyncio.create_task(run(e, "short-b", PROMPT, "b", max_tokens=1))
        await advance(0.1)  # a few of long-a's 30 decode steps
        assert not short_b.done() and not long_a.done()
        await asyncio.wait_for(asyncio.gather(long_a, short_b), 10)
        assert e.adapters is not None and e.adapters.is_resident("b") and not e.adapters.is_resident("a")
    finally:
        await e.stop()


async def test_an_adapter_registered_at_run_time_serves_requests(tmp_path: Path) -> None:
    e = engine(tmp_path, names="a")
    await e.start()
    try:
        assert e.adapters is not None and [s.name for s in e.adapters.states()] == ["a"]
        e.adapters.register("c", adapter_dir(tmp_path, "c", size=ADAPTER_BYTES))
        c_tokens, _ = await run(e, "c1", PROMPT, "c")
        assert c_tokens != (await run(e, "a1", PROMPT, "a"))[0]
    finally:
        await e.stop()


async def test_an_unknown_adapter_or_one_on_a_worker_without_lora_is_a_named_error(tmp_path: Path) -> None:
    with_lora, without = engine(tmp_path), engine(None)
    await with_lora.start()
    await without.start()
    try:
        for e, lora, kind in ((with_lora, "nope", AdapterErrorKind.UNKNOWN), (without, "a", AdapterErrorKind.DISABLED)):
            with pytest.raises(AdapterError, match="nope" if kind is AdapterErrorKind.UNKNOWN else "--enable-lora") as caught:
                await run(e, "x", PROMPT, lora)
            assert caught.value.kind is kind
            load = e.load()
            assert load.num_requests_waiting == 0 and load.kv_active_blocks == 0
    finally:
        await with_lora.stop()
        await without.stop()


def test_a_bad_adapter_in_the_start_flags_fails_the_engines_start(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    lora = LoraConfig(enabled=True, modules=(LoraModule("bad", str(tmp_path / "empty")),))
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        MockerEngine(MockerConfig(str(ensure_demo_model()), "demo", lora=lora))


@virtual_time
async def test_stopping_the_engine_fails_a_load_waiting_on_its_step(tmp_path: Path) -> None:
    cost = replace(TimingModel().cost, adapter_load_base_s=30.0)
    e = engine(tmp_path, speedup=1, cost=cost)
    await e.start()
    loading = asyncio.create_task(run(e, "slow", PROMPT, "a"))
    await advance(1.0)  # into the step that loads the adapter for 30 s
    assert not loading.done()
    await e.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        await asyncio.wait_for(loading, 2)


async def test_a_kv_pull_of_another_adapters_prompt_is_refused(tmp_path: Path) -> None:
    e = engine(tmp_path)
    await e.start()
    try:
        pulls = [({"lora_name": "b"}, "a", "LoRA adapter 'b', but the request runs LoRA adapter 'a'"),
                 ({"lora_name": "a"}, "", "LoRA adapter 'a', but the request runs the base model"),
                 ({}, "a", "the base model, but the request runs LoRA adapter 'a'")]
        for params, lora, message in pulls:
            with pytest.raises(KvTransferError, match=message):
                await run(e, "pulled", PROMPT, lora, kv_pull=params)
        check_pull_adapter({"lora_name": "a"}, "a")
        check_pull_adapter({}, "")  # parameters from before adapters: the base model's
    finally:
        await e.stop()


async def test_disaggregated_output_with_an_adapter_equals_aggregated(tmp_path: Path) -> None:
    pytest.importorskip("nixl")
    from services.engines.mocker.kv_transfer import NixlKvEndpoint

    prefill_kv = NixlKvEndpoint("lora-prefill", bytes_per_token=64, arena_bytes=1 << 20)
    metadata = prefill_kv.metadata()

    async def lookup(peer: str) -> bytes | None:
        return metadata if peer == "lora-prefill" else None

    decode_kv = NixlKvEndpoint("lora-decode", bytes_per_token=64, metadata_lookup=lookup, arena_bytes=1 << 20)
    config = engine(tmp_path).config
    prefill, decode, aggregated = (MockerEngine(config, prefill_kv), MockerEngine(config, decode_kv),
                                   engine(tmp_path))
    for e in (prefill, decode, aggregated):
        await e.start()
    try:
        held = await prefill.prefill(EngineRequest("r1", PROMPT, Sampling(max_tokens=12), lora_name="a"))
        assert held.kv_pull["lora_name"] == "a"
        disagg, _ = await run(decode, "r1", PROMPT, "a", 12, kv_pull=held.kv_pull)
        assert disagg == (await run(aggregated, "r1", PROMPT, "a", 12))[0]
        other = await prefill.prefill(EngineRequest("r2", PROMPT, Sampling(max_tokens=12), lora_name="b"))
        with pytest.raises(KvTransferError, match="refusing"):
            await run(decode, "r2", PROMPT, "a", 12, kv_pull=other.kv_pull)
        await prefill.release_kv("r2")
    finally:
        for e in (prefill, decode, aggregated):
            await e.stop()


def test_the_timing_model_charges_an_adapter_load_by_its_size_and_the_speedup() -> None:
    t = TimingModel()
    assert t.adapter_load_seconds(0) == pytest.approx(0.02)
    assert t.adapter_load_seconds(2_000_000_000) == pytest.approx(0.02 + 1.0)  # 2 GB at 2 GB/s
    assert TimingModel(speedup=10).adapter_load_seconds(2_000_000_000) == pytest.approx(0.102)
    assert TimingModel(speedup=float("inf")).adapter_load_seconds(2_000_000_000) == 0
    assert t.cost.scaled(2).adapter_load_s(0) == pytest.approx(0.04)


def test_a_profile_may_set_the_adapter_load_cost_or_leave_it_out(tmp_path: Path) -> None:
    preset = load_profile("h100-8b")
    assert preset.cost.adapter_load_s(1_000_000_000) == pytest.approx(0.02 + 0.5)
    custom = preset.cost.to_dict() | {"adapter_load_base_s": 0.1, "adapter_load_s_per_gb": 2.0}
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"format": FORMAT, "cost_model": custom}))
    assert load_profile(str(path)).cost.adapter_load_s(500_000_000) == pytest.approx(0.1 + 1.0)
    assert TimingModel.of_profile(str(path), speedup=2).adapter_load_seconds(0) == pytest.approx(0.05)
