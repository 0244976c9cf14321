"""The mocker engine: a real block manager with prefix caching and eviction, deterministic tokens."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from services.kv_protocol.hashing import chained_block_hashes, local_block_hashes
from services.engines.base import EngineRequest, Sampling
from services.kv_protocol.events import KvRemoved, KvStored
from services.engines.mocker.block_manager import BlockManager
from services.engines.mocker.engine import MockerConfig, MockerEngine
from services.engines.mocker.timing import TimingModel
from services.tools.make_demo_model import DemoModelSpec, ensure_demo_model
from tests.procs import eventually

BS = 4


def make_blocks(num_blocks: int) -> tuple[BlockManager, list]:
    events: list = []
    return BlockManager(num_blocks, BS, events.append), events


def seq(tokens: list[int]) -> tuple[list[int], list[int]]:
    return chained_block_hashes(tokens, BS), local_block_hashes(tokens, BS)


def test_full_blocks_are_cached_and_announced_with_their_parent() -> None:
    bm, events = make_blocks(8)
    chain, locals_ = seq(list(range(10)))  # 2 full blocks + 2 tokens
    blocks, hit, _ = bm.allocate(chain, locals_, 10)
    assert hit == 0 and len(blocks) == 3
    assert events == [KvStored(None, ((chain[0], locals_[0]), (chain[1], locals_[1])))]
    assert bm.active_blocks == 3


def test_a_shared_prefix_is_reused_and_only_new_blocks_are_announced() -> None:
    bm, events = make_blocks(8)
    a = list(range(8))
    b = list(range(4)) + [99, 98, 97, 96]
    ca, la = seq(a)
    bm.allocate(ca, la, 8)
    cb, lb = seq(b)
    blocks, hit, _ = bm.allocate(cb, lb, 8)
    assert hit == 1
    assert events[-1] == KvStored(ca[0], ((cb[1], lb[1]),))
    assert bm.active_blocks == 3  # the shared first block is counted once


def test_freed_blocks_stay_cached_until_space_is_needed_then_lru_goes_first() -> None:
    bm, events = make_blocks(4)
    c1, l1 = seq(list(range(8)))
    c2, l2 = seq(list(range(100, 108)))
    b1, _, _ = bm.allocate(c1, l1, 8)
    bm.free(b1)
    b2, _, _ = bm.allocate(c2, l2, 8)
    bm.free(b2)
    assert bm.active_blocks == 0 and bm.cached_prefix_blocks(c1) == 2
    c3, l3 = seq(list(range(200, 208)))
    bm.allocate(c3, l3, 8)
    removed = [e for e in events if isinstance(e, KvRemoved)]
    assert len(removed) == 1
    # The first sequence's blocks were freed first; the tail of a chain is freed before its head.
    assert set(removed[0].block_hashes) == set(c1)
    assert bm.cached_prefix_blocks(c2) == 2


def test_allocation_fails_cleanly_when_every_block_is_referenced() -> None:
    bm, _ = make_blocks(2)
    c1, l1 = seq(list(range(8)))
    assert bm.allocate(c1, l1, 8) is not None
    c2, l2 = seq(list(range(50, 58)))
    assert bm.allocate(c2, l2, 8) is None
    assert bm.append_block() is None


def engine(num_blocks: int = 1024, speedup: float = float("inf"), block_size: int = 16) -> MockerEngine:
    return MockerEngine(MockerConfig(str(ensure_demo_model()), "demo", block_size=block_size,
                                     num_gpu_blocks=num_blocks, timing=TimingModel(speedup=speedup)))


async def run(e: MockerEngine, rid: str, tokens: list[int], max_tokens: int = 8, **sampling) -> tuple[list[int], int, str]:
    out: list[int] = []
    cached, finish = 0, ""
    async for o in e.generate(EngineRequest(rid, tokens, Sampling(max_tokens=max_tokens, **sampling))):
        out += o.token_ids
        cached = o.cached_tokens
        finish = o.finish_reason or finish
    return out, cached, finish


async def test_output_is_a_pure_function_of_prompt_params_and_position() -> None:
    a, b = engine(), engine()
    await a.start()
    await b.start()
    try:
        prompt = list(range(20, 60))
        first, _, finish = await run(a, "r1", prompt, 12)
        assert finish == "length" and len(first) == 12
        assert (await run(b, "r2", prompt, 12))[0] == first
        assert (await run(a, "r3", prompt, 5))[0] == first[:5]
        assert (await run(a, "r4", prompt, 12, seed=1))[0] != first
    finally:
        await a.stop()
        await b.stop()


async def test_a_request_resumed_on_another_worker_continues_exactly() -> None:
    a, b = engine(), engine()
    await a.start()
    await b.start()
    try:
        prompt = list(range(20, 60))
        whole, _, _ = await run(a, "r1", prompt, 12, seed=3)
        # Worker a died after 5 tokens: b gets the prompt plus those 5, and 7 more to make.
        rest: list[int] = []
        request = EngineRequest("r1~1", prompt + whole[:5], Sampling(max_tokens=7, seed=3), resumed_tokens=5)
        async for o in b.generate(request):
            rest += o.token_ids
        assert whole[:5] + rest == whole
    finally:
        await a.stop()
        await b.stop()


async def test_answers_end_with_end_of_sequence_at_answer_tokens_unless_eos_is_ignored() -> None:
    e = MockerEngine(MockerConfig(str(ensure_demo_model()), "demo", timing=TimingModel(speedup=float("inf")),
                                  answer_tokens=6))
    other = engine()
    await e.start()
    await other.start()
    try:
        prompt = list(range(20, 60))
        eos = e.info.eos_token_ids[0]
        out, _, finish = await run(e, "r1", prompt, 50)
        plain, _, _ = await run(other, "r1", prompt, 50)
        assert finish == "stop" and len(out) == 6 and out[-1] == eos
        assert out[:5] == plain[:5]  # the same tokens up to the end: only where it ends differs
        short, _, finish = await run(e, "r2", prompt, 4)
        assert finish == "length" and len(short) == 4
        ignored, _, finish = await run(e, "r3", prompt, 12, ignore_eos=True)
        assert finish == "length" and len(ignored) == 12 and eos not in ignored
        longer, _, finish = await run(e, "r4", prompt, 50, min_tokens=9)
        assert finish == "stop" and len(longer) == 9
        # Resumed on another worker after 3 tokens, the answer ends where it would have.
        rest: list[int] = []
        request = EngineRequest("r1~1", prompt + out[:3], Sampling(max_tokens=47), resumed_tokens=3)
        async for o in e.generate(request):
            rest += o.token_ids
        assert out[:3] + rest == out
    finally:
        await e.stop()
        await other.stop()


async def test_with_answer_tokens_a_max_tokens_past_the_cache_is_served_as_the_answer_ends_sooner() -> None:
    # 8 blocks of 16 tokens: a 40-token prompt with max_tokens 1,000 would need 65.
    config = MockerConfig(str(ensure_demo_model()), "demo", num_gpu_blocks=8, timing=TimingModel(speedup=float("inf")))
    ending, endless = MockerEngine(replace(config, answer_tokens=6)), MockerEngine(config)
    await ending.start()
    await endless.start()
    try:
        out, _, finish = await run(ending, "r1", list(range(20, 60)), 1000)
        assert finish == "stop" and len(out) == 6
        with pytest.raises(ValueError, match="KV blocks"):
            await run(endless, "r1", list(range(20, 60)), 1000)
        with pytest.raises(ValueError, match="KV blocks"):  # an answer that ignores EOS runs to max_tokens
            await run(ending, "r2", list(range(20, 60)), 1000, ignore_eos=True)
    finally:
        await ending.stop()
        await endless.stop()


async def test_second_request_with_the_same_prefix_hits_the_cache() -> None:
    e = engine()
    await e.start()
    try:
        prompt = list(range(100, 164))  # 4 full blocks of 16
        _, cached_first, _ = await run(e, "a", prompt)
        _, cached_second, _ = await run(e, "b", prompt + [7, 8, 9])
        assert cached_first == 0
        assert cached_second == 64
        assert e.load().gpu_prefix_cache_hit_rate > 0
    finally:
        await e.stop()


async def test_many_concurrent_requests_in_a_small_cache_all_finish() -> None:
    e = engine(num_blocks=24, speedup=1000)
    await e.start()
    try:
        results = await asyncio.wait_for(asyncio.gather(
            *(run(e, f"r{i}", list(range(i * 100, i * 100 + 40)), 40) for i in range(8))), 60)
        assert all(len(tokens) == 40 and finish == "length" for tokens, _, finish in results)
        load = e.load()
        assert load.request_active_slots == 0 and load.num_requests_waiting == 0 and load.kv_active_blocks == 0
    finally:
        await e.stop()


async def test_closing_the_stream_aborts_and_frees_the_blocks() -> None:
    e = engine(speedup=100)
    await e.start()
    try:
        stream = e.generate(EngineRequest("x", list(range(64)), Sampling(max_tokens=1000)))
        await anext(stream)
        assert e.load().kv_active_blocks > 0
        await stream.aclose()
        assert await eventually(lambda: e.load().kv_active_blocks == 0 and e.load().request_active_slots == 0, 5)
    finally:
        await e.stop()


async def test_a_request_larger_than_the_whole_cache_is_refused() -> None:
    e = engine(num_blocks=4)
    await e.start()
    try:
        with pytest.raises(ValueError, match="KV blocks"):
            await run(e, "big", list(range(100)), 10)
    finally:
        await e.stop()


async def test_the_mocker_serves_its_max_model_len_past_the_models_own_and_refuses_a_longer_prompt() -> None:
    model = str(ensure_demo_model())
    assert MockerEngine(MockerConfig(model, "demo")).info.max_model_len == DemoModelSpec().max_context  # config.json's
    e = MockerEngine(MockerConfig(model, "demo", max_model_len=200_000, num_gpu_blocks=16384))
    assert e.info.max_model_len == 200_000  # no weights: any length (what the worker publishes)
    short = MockerEngine(MockerConfig(model, "demo", max_model_len=64))
    await short.start()
    try:
        with pytest.raises(ValueError, match="longer than the maximum model length of 64"):
            await run(short, "long", list(range(65)), 1)
        assert len((await run(short, "fits", list(range(60)), 4))[0]) == 4
    finally:
        await short.stop()


def test_timing_model_charges_uncached_prefill_and_batch_size() -> None:
    t = TimingModel()
    assert t.step_seconds([2000], 0) > t.step_seconds([200], 0) > 0
    assert t.step_seconds([], 64) > t.step_seconds([], 1) > 0
    assert TimingModel(speedup=10).step_seconds([2000], 8) == pytest.approx(t.step_seconds([2000], 8) / 10)
    assert TimingModel(speedup=float("inf")).step_seconds([2000], 8) == 0
    # Prompts in one step share its prefill base; each pays its own attention over itself.
    c = t.cost
    assert t.step_seconds([1000, 1000], 0) == pytest.approx(c.prefill_base_s + 2 * c.prompt_s(1000))
    assert t.step_seconds([1000, 1000], 0) < t.step_seconds([2000], 0)


async def test_move_out_hands_over_the_requests_asked_for_at_a_step_boundary_and_leaves_the_rest() -> None:
    # No NIXL arena here: handed over without KV (the e2e tests move it), blocks freed at once.
    e = engine(speedup=100)
    await e.start()
    try:
        streams = {rid: e.generate(EngineRequest(rid, list(range(i, i + 40)), Sampling(max_tokens=1000)))
                   for i, rid in enumerate(("a", "b"))}
        firsts = {rid: await anext(s) for rid, s in streams.items()}
        assert all(o.finish_reason is None for o in firsts.values())
        assert await e.move_out({"b"}) == 1
        outs = [o async for o in streams["b"]]
        assert outs[-1].finish_reason == "moved" and outs[-1].kv_pull is None and outs[-1].token_ids == []
        assert all(o.finish_reason is None for o in outs[:-1]), "every token before the handoff went out as usual"
        assert e.load().request_active_slots == 1 and not e.can_move and e.moves_unpulled() == 0
        # "a" runs on; nothing is left of "b" (its blocks freed: it held no KV for a pull).
        assert (await anext(streams["a"])).finish_reason is None
        await streams["a"].aclose()
        assert await eventually(lambda: e.load().kv_active_blocks == 0, 5)
        assert await e.move_out() == 0, "nothing to hand over: the next boundary answers at once"
    finally:
        await e.stop()
