"""Session pins on the mocker, in-process: a session's blocks survive other traffic between its
turns (pinned on the device within a budget, else protected in the host tier), pins expire, a
session's next request brings its prefix back from host memory ahead of admission, and the KV
events still say exactly what each tier holds."""

from __future__ import annotations

import asyncio
import random

import pytest

from services.engines.base import EngineRequest, Sampling, SessionRetention
from services.engines.mocker.block_manager import BlockManager
from services.engines.mocker.config import MockerConfig
from services.engines.mocker.engine import MockerEngine
from services.engines.mocker.session_pins import SessionPins
from services.engines.mocker.timing import TimingModel
from services.kv_protocol.events import KvEventData, KvRemoved, KvStored
from services.kv_protocol.hashing import SequenceHash, chained_block_hashes, local_block_hashes
from services.kv_protocol.tier import Tier
from services.config_error import ConfigError
from services.mesh.flags import ModelRef
from services.tools.make_demo_model import ensure_demo_model
from services.worker.engine_factory import build_engine
from services.worker.engine_flags import EngineConfig
from tests.unit.clocks import until, virtual_time
from tests.unit.budget import examples

BS = 4


class Tiers:
    """The KV events replayed into what each tier holds, checking each is exact as it comes: a
    block stored where it is not yet, under a parent held somewhere; removed from where it is."""

    def __init__(self) -> None:
        self.held: dict[Tier, set[SequenceHash]] = {Tier.DEVICE: set(), Tier.HOST: set()}
        self.log: list[KvEventData] = []

    def __call__(self, event: KvEventData) -> None:
        self.log.append(event)
        if isinstance(event, KvStored):
            tier = self.held[event.tier]
            parent = event.parent_hash
            for h, _ in event.blocks:
                assert parent is None or parent in self.held[Tier.DEVICE] | self.held[Tier.HOST], "orphan stored"
                assert h not in tier, "stored twice"
                tier.add(h)
                parent = h
        elif isinstance(event, KvRemoved):
            tier = self.held[event.tier]
            assert set(event.block_hashes) <= tier, "removed what the tier did not hold"
            tier.difference_update(event.block_hashes)

    def check(self, bm: BlockManager) -> None:
        device, host = self.held[Tier.DEVICE], self.held[Tier.HOST]
        assert device == set(bm._by_hash) and host == set(bm._host)
        assert not device & host, "a block in two tiers"
        # No block is stranded: its parent is cached in some tier.
        for block, h in enumerate(bm._hash_of):
            if h in device:
                parent = bm._parent_of[block]
                assert parent is None or parent in device or parent in host
        for parent, _, _ in bm._host.values():
            assert parent is None or parent in device or parent in host


def chain(tokens: list[int]) -> tuple[list, list]:
    return chained_block_hashes(tokens, BS), local_block_hashes(tokens, BS)


def run(bm: BlockManager, tokens: list[int]) -> list[int]:
    """Allocates a sequence and returns its blocks (still held)."""
    hashes, locals_ = chain(tokens)
    allocation = bm.allocate(hashes, locals_, len(tokens))
    assert allocation is not None
    return allocation[0]


def finish(bm: BlockManager, pins: SessionPins | None, session: str, tokens: list[int], now: float = 0.0,
           retain_s: float = 60.0) -> list:
    """A request of `session` (or of none) runs `tokens` and ends: pinned, then freed."""
    blocks = run(bm, tokens)
    hashes = chain(tokens)[0]
    if pins is not None:
        pins.kept(session, hashes, retain_s, now)
    bm.free(blocks)
    return hashes


def churn(bm: BlockManager, start: int, count: int, blocks_each: int = 2) -> None:
    for i in range(count):
        bm.free(run(bm, list(range(1000 + (start + i) * 100, 1000 + (start + i) * 100 + blocks_each * BS))))


def test_a_pinned_session_survives_pressure_that_evicts_everything_else() -> None:
    tiers = Tiers()
    bm = BlockManager(8, BS, tiers)
    pins = SessionPins(bm, device_budget=4, host_budget=0)
    mine = finish(bm, pins, "s", list(range(8)))
    theirs = finish(bm, None, "", list(range(50, 58)))
    churn(bm, 0, 10)
    assert bm.cached_prefix_blocks(mine) == 2 and bm.cached_prefix_blocks(theirs) == 0
    assert bm.pinned_blocks == 2 and bm.active_blocks == 0 and bm.free_blocks == 6
    # The cache fails an allocation rather than evict a pinned block.
    hashes, locals_ = chain(list(range(300, 328)))
    assert bm.allocate(hashes, locals_, 28) is None
    tiers.check(bm)


def test_past_the_budget_the_oldest_session_is_kept_in_host_memory_while_the_rest_is_dropped() -> None:
    tiers = Tiers()
    bm = BlockManager(8, BS, tiers, host_blocks=8)
    pins = SessionPins(bm, device_budget=2, host_budget=4)
    old = finish(bm, pins, "old", list(range(8)), now=0.0)
    new = finish(bm, pins, "new", list(range(20, 28)), now=1.0)
    assert bm.pinned_blocks == 2 and pins.demoted_blocks_total == 2
    churn(bm, 0, 12)  # 24 blocks through a device of 6 free and a host tier of 8
    assert bm.cached_prefix_blocks(new) == 2
    assert bm.cached_prefix_blocks(old) == 0 and bm.host_prefix_blocks(old, 0) == 2
    assert bm.host_protected_blocks == 2 and bm.host_active_blocks == 8
    first = chain(list(range(1000, 1008)))[0]
    assert bm.cached_prefix_blocks(first) == 0 and bm.host_prefix_blocks(first, 0) == 0  # others dropped
    load = pins.load()
    assert (load.pins, load.device_blocks, load.host_blocks) == (2, 2, 2)
    tiers.check(bm)


def test_host_protection_is_bounded_and_the_oldest_demoted_session_loses_it_first() -> None:
    bm = BlockManager(16, BS, Tiers(), host_blocks=8)
    pins = SessionPins(bm, device_budget=0, host_budget=4)
    a = finish(bm, pins, "a", list(range(8)), now=0.0)
    finish(bm, pins, "b", list(range(20, 28)), now=1.0)
    finish(bm, pins, "c", list(range(40, 48)), now=2.0)  # a's protection goes
    assert len(pins) == 2 and bm.pinned_blocks == 0
    churn(bm, 0, 20)
    assert bm.host_prefix_blocks(a, 0) == 0
    assert bm.host_prefix_blocks(chain(list(range(20, 28)))[0], 0) == 2
    assert bm.host_prefix_blocks(chain(list(range(40, 48)))[0], 0) == 2


def test_a_pin_expires_after_its_retention_and_its_blocks_become_evictable() -> None:
    bm = BlockManager(8, BS, Tiers())
    pins = SessionPins(bm, device_budget=4, host_budget=0)
    mine = finish(bm, pins, "s", list(range(8)), now=10.0, retain_s=5.0)
    assert pins.next_expiry() == 15.0
    pins.expire(14.9)
    assert len(pins) == 1 and bm.free_blocks == 6
    pins.expire(15.0)
    assert len(pins) == 0 and bm.pinned_blocks == 0 and bm.free_blocks == 8
    churn(bm, 0, 10)
    assert bm.cached_prefix_blocks(mine) == 0


def test_the_next_turn_replaces_the_pin_and_a_running_request_takes_pinned_blocks_first() -> None:
    bm = BlockManager(8, BS, Tiers())
    pins = SessionPins(bm, device_budget=4, host_budget=0)
    finish(bm, pins, "s", list(range(8)), now=0.0)
    turn = list(range(8)) + list(range(100, 108))
    blocks = run(bm, turn)  # the next turn starts: its blocks are the request's now
    pins.started("s")
    assert len(pins) == 0 and bm.pinned_blocks == 0
    pins.kept("s", chain(turn)[0], 60.0, 1.0)
    bm.free(blocks)
    assert bm.pinned_blocks == 4 and len(pins) == 1
    assert pins.yield_device() and bm.pinned_blocks == 0 and not pins.yield_device()


def test_a_sessions_next_request_brings_its_prefix_back_from_host_memory_on_arrival() -> None:
    tiers = Tiers()
    bm = BlockManager(8, BS, tiers, host_blocks=8)
    pins = SessionPins(bm, device_budget=4, host_budget=4)
    mine = finish(bm, pins, "s", list(range(8)), now=0.0)
    pins.yield_device()  # demoted: protected in host memory
    churn(bm, 0, 8)
    assert bm.cached_prefix_blocks(mine) == 0 and bm.host_prefix_blocks(mine, 0) == 2
    seen = len(tiers.log)
    turn = chain(list(range(8)) + list(range(100, 108)))[0]
    assert pins.arrived("s", turn, 60.0, 1.0) == 2
    assert bm.cached_prefix_blocks(turn) == 2 and bm.host_prefix_blocks(turn, 0) == 0
    assert bm.pinned_blocks == 2 and bm.host_hit_blocks == 2 and pins.prefetched_blocks_total == 2
    events = tiers.log[seen:]
    stored = next(i for i, e in enumerate(events) if isinstance(e, KvStored) and e.tier == Tier.DEVICE
                  and {h for h, _ in e.blocks} == set(mine))
    removed = next(i for i, e in enumerate(events) if isinstance(e, KvRemoved) and e.tier == Tier.HOST
                   and set(e.block_hashes) == set(mine))
    assert stored < removed
    tiers.check(bm)
    blocks, hit, host_hit = bm.allocate(turn, chain(list(range(8)) + list(range(100, 108)))[1], 16) or ([], 0, 0)
    assert (hit, host_hit) == (2, 0)
    pins.started("s")
    bm.free(blocks)
    tiers.check(bm)


def test_the_events_say_exactly_what_each_tier_holds_through_random_session_traffic() -> None:
    rng = random.Random(11)
    for trial in range(examples(40)):
        tiers = Tiers()
        bm = BlockManager(rng.randint(8, 24), BS, tiers, host_blocks=rng.choice([0, 6, 16]))
        pins = SessionPins(bm, device_budget=rng.randint(0, 8), host_budget=bm.host_blocks // 2)
        histories = {f"s{i}": [i * 1000 + t for t in range(rng.randint(1, 3) * BS)] for i in range(4)}
        running: list[tuple[str, list[int], list[int]]] = []
        now = 0.0
        for _ in range(60):
            now += rng.random()
            op = rng.random()
            if op < 0.35 and len(running) < 3:  # a session's next turn (or plain traffic) starts
                session = rng.choice([*histories, ""])
                base = histories.get(session, [rng.randrange(5000, 5100) for _ in range(BS)])
                tokens = base + [rng.randrange(7000, 9000) for _ in range(rng.randint(0, 2 * BS))]
                hashes, locals_ = chain(tokens)
                if session:
                    pins.arrived(session, hashes, 5.0, now)
                allocation = bm.allocate(hashes, locals_, len(tokens))
                if allocation is None and not running:
                    while allocation is None and pins.yield_device():
                        allocation = bm.allocate(hashes, locals_, len(tokens))
                if allocation is not None:
                    if session:
                        pins.started(session)
                    running.append((session, tokens, allocation[0]))
            elif op < 0.7 and running:  # one ends (its session pinned) or is cancelled
                session, tokens, blocks = running.pop(rng.randrange(len(running)))
                if session:
                    pins.kept(session, chain(tokens)[0], 5.0, now)
                    histories[session] = tokens
                bm.free(blocks)
            elif op < 0.8 and running:  # one decodes a block's worth of tokens
                i = rng.randrange(len(running))
                session, tokens, blocks = running[i]
                grown = tokens + [rng.randrange(7000, 9000) for _ in range(BS)]
                while len(blocks) * BS < len(grown):
                    block = bm.append_block()
                    while block is None and pins.yield_device():
                        block = bm.append_block()
                    if block is None:
                        break
                    blocks.append(block)
                else:
                    hashes, locals_ = chain(grown)
                    for b in range(len(tokens) // BS, len(grown) // BS):
                        bm.cache_block(blocks[b], hashes[b - 1] if b else None, hashes[b], locals_[b])
                    running[i] = (session, grown, blocks)
            elif op < 0.9:
                pins.expire(now)
            else:
                pins.yield_device()
            tiers.check(bm)
            assert bm.pinned_blocks == sum(1 for p in bm._pins if p)
            assert bm.pinned_blocks <= pins.device_budget or not pins._device
            assert bm.host_protected_blocks <= max(pins.host_budget, 0), trial
            assert bm.active_blocks == sum(1 for r in bm._refs if r)
        for _, _, blocks in running:
            bm.free(blocks)
        pins.expire(now + 10)
        assert len(pins) == 0 and bm.pinned_blocks == 0 and bm.host_protected_blocks == 0
        assert bm.free_blocks == bm.num_blocks and not bm._protect
        tiers.check(bm)


# -- the engine ---------------------------------------------------------------------------------

def engine(num_blocks: int, host_blocks: int = 0, pin_blocks: int = -1) -> MockerEngine:
    return MockerEngine(MockerConfig(str(ensure_demo_model()), "demo", num_gpu_blocks=num_blocks,
                                     host_kv_blocks=host_blocks, session_pin_blocks=pin_blocks,
                                     timing=TimingModel(speedup=float("inf"))))


async def turn(e: MockerEngine, rid: str, tokens: list[int], session: str | None,
               retain_s: float = 60.0) -> tuple[list[int], int]:
    retention = SessionRetention(session, retain_s) if session else None
    out: list[int] = []
    cached = 0
    async for o in e.generate(EngineRequest(rid, tokens, Sampling(max_tokens=8), session=retention)):
        out += o.token_ids
        cached = o.cached_tokens
    return out, cached


async def second_turn_cached(e: MockerEngine, session: str | None) -> int:
    await e.start()
    try:
        prompt = list(range(100, 164))  # 4 full blocks of 16
        out, _ = await turn(e, "t1", prompt, session)
        for i in range(12):  # other traffic: 6 blocks each, far more than the cache holds
            await turn(e, f"bg{i}", list(range(10_000 + i * 1000, 10_000 + i * 1000 + 96)), None)
        _, cached = await turn(e, "t2", prompt + out + list(range(500, 540)), session)
        return cached
    finally:
        await e.stop()


async def test_a_sessions_second_turn_finds_its_prefix_pinned_on_the_device() -> None:
    e = engine(32)
    assert await second_turn_cached(e, "agent") == 64
    load = e.load().sessions
    assert load is not None and load.pins == 1 and load.device_blocks >= 4 and load.device_budget == 8
    assert await second_turn_cached(engine(32), None) == 0


async def test_with_no_device_pins_the_session_waits_in_host_memory_and_comes_back_on_arrival() -> None:
    e = engine(32, host_blocks=16, pin_blocks=0)
    assert await second_turn_cached(e, "agent") == 64
    load = e.load().sessions
    assert load is not None and load.prefetched_blocks_total == 4 and load.demoted_blocks_total >= 4
    assert await second_turn_cached(engine(32, host_blocks=16, pin_blocks=0), None) == 0


async def test_pins_give_way_to_a_request_that_needs_the_whole_device() -> None:
    e = engine(16, pin_blocks=8)
    await e.start()
    try:
        await turn(e, "a", list(range(100, 164)), "a")
        await turn(e, "b", list(range(200, 264)), "b")
        assert e.blocks.pinned_blocks == 8
        out, _ = await asyncio.wait_for(turn(e, "big", list(range(1000, 1000 + 15 * 16)), None), 10)
        assert len(out) == 8 and e.blocks.pinned_blocks < 8
    finally:
        await e.stop()


@virtual_time
async def test_an_idle_engine_lets_a_pin_go_when_its_retention_ends() -> None:
    e = engine(32)
    await e.start()
    try:
        await turn(e, "a", list(range(100, 164)), "a", retain_s=0.05)
        assert e.blocks.pinned_blocks == 4
        loop = asyncio.get_running_loop()
        kept_until = loop.time() + 0.05
        await until(lambda: e.blocks.pinned_blocks == 0 and len(e.sessions) == 0)
        assert loop.time() == pytest.approx(kept_until, abs=0.002)  # let go when its retention ended
        assert e.sessions.next_expiry() is None
    finally:
        await e.stop()


@virtual_time
async def test_a_prefetch_not_done_by_admission_holds_the_step_for_the_rest_of_its_transfer() -> None:
    # 4 blocks of 16 tokens at 1 MiB a token over a 0.5 GB/s link: 0.134 s on the link.
    e = MockerEngine(MockerConfig(str(ensure_demo_model()), "demo", num_gpu_blocks=32, host_kv_blocks=16,
                                  session_pin_blocks=0, kv_bytes_per_token=1 << 20, host_kv_gbps=0.5))
    await e.start()
    try:
        prompt = list(range(100, 164))
        out, _ = await turn(e, "t1", prompt, "agent")
        for i in range(12):
            await turn(e, f"bg{i}", list(range(10_000 + i * 1000, 10_000 + i * 1000 + 96)), None)
        stream = e.generate(EngineRequest("t2", prompt + out, Sampling(max_tokens=1),
                                          session=SessionRetention("agent", 60.0)))
        started = asyncio.get_running_loop().time()
        first = await anext(stream)
        assert first.cached_tokens == 64 and e.sessions.prefetched_blocks_total == 4
        assert asyncio.get_running_loop().time() - started >= 0.13
        await stream.aclose()
    finally:
        await e.stop()


def test_the_pin_budget_flag_defaults_to_a_quarter_of_the_device_and_refuses_below_minus_one() -> None:
    model = ensure_demo_model()
    assert MockerConfig(str(model), "demo", num_gpu_blocks=1000).pin_budget == 250
    assert MockerConfig(str(model), "demo", num_gpu_blocks=1000, session_pin_blocks=0).pin_budget == 0
    assert EngineConfig("mocker", ModelRef(str(model), model.name), 16).session_pin_blocks == -1
    with pytest.raises(ConfigError, match="--session-pin-blocks"):
        EngineConfig("mocker", ModelRef(str(model), model.name), 16, session_pin_blocks=-2)
    built = build_engine(EngineConfig("mocker", ModelRef(str(model), model.name), 16, session_pin_blocks=7),
                         "w", None, "kvmesh", kv_events=False)  # type: ignore[arg-type]  # no store: no NIXL
    assert isinstance(built.engine, MockerEngine) and built.engine.sessions.device_budget == 7
