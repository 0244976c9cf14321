"""The host-memory KV tier's rules, in-process: the mocker keeps what its device evicts and loads
it back on a hit, its events keep the router's index whole across tiers, and the cost function
credits a host hit by what it saves. tests/e2e/test_kv_tiers.py runs them on real processes."""

from __future__ import annotations

import random

import pytest

from gen.kvmesh.v1 import worker_pb2
from services.engines.mocker.block_manager import BlockManager
from services.kv_protocol.events import KvEventData, KvRemoved, KvStored
from services.kv_protocol.hashing import chained_block_hashes, local_block_hashes
from services.kv_protocol.tier import Tier
from services.routing.cost_function import Candidate, CostWeights, choose
from services.routing.host_credit import FALLBACK_CREDIT, host_credit
from services.routing.kv_index import apply_kv_event
from services.routing.radix_tree import RadixTree
from services.worker.kv_event_log import KvEventLog

BS = 4


def seq(tokens: list[int]) -> tuple[list, list]:
    return chained_block_hashes(tokens, BS), local_block_hashes(tokens, BS)


def tiered(num_blocks: int, host_blocks: int) -> tuple[BlockManager, list[KvEventData]]:
    events: list[KvEventData] = []
    return BlockManager(num_blocks, BS, events.append, host_blocks), events


def run(bm: BlockManager, tokens: list[int]) -> tuple[int, int]:
    """Allocates a sequence and frees it at once (a finished request); (device hit, host hit)."""
    chain, locals_ = seq(tokens)
    allocation = bm.allocate(chain, locals_, len(tokens))
    assert allocation is not None
    blocks, hit, loaded = allocation
    bm.free(blocks)
    return hit, loaded


def test_an_evicted_block_moves_to_host_memory_before_the_device_lets_go_of_it() -> None:
    bm, events = tiered(4, 8)
    a, b = list(range(8)), list(range(100, 108))
    run(bm, a)
    run(bm, b)
    run(bm, list(range(200, 208)))  # pushes `a` out of the device
    ca, _ = seq(a)
    moved = [e for e in events if isinstance(e, KvStored) and e.tier == Tier.HOST]
    assert {h for e in moved for h, _ in e.blocks} >= set(ca)
    for h in ca:  # each block: stored in host memory, then removed from the device
        stored_at = next(i for i, e in enumerate(events) if isinstance(e, KvStored) and e.tier == Tier.HOST
                         and any(x == h for x, _ in e.blocks))
        removed_at = next(i for i, e in enumerate(events) if isinstance(e, KvRemoved) and e.tier == Tier.DEVICE
                          and h in e.block_hashes)
        assert stored_at < removed_at
    assert bm.cached_prefix_blocks(ca) == 0 and bm.host_prefix_blocks(ca, 0) == 2


def test_a_prefix_in_host_memory_is_loaded_back_instead_of_recomputed() -> None:
    bm, events = tiered(4, 8)
    a = list(range(8))
    run(bm, a)
    run(bm, list(range(100, 108)))
    run(bm, list(range(200, 208)))
    before = len(events)
    assert run(bm, a + [1, 2]) == (0, 2)
    assert bm.host_hit_blocks == 2
    ca, _ = seq(a)
    after = events[before:]
    device_stored = next(i for i, e in enumerate(after) if isinstance(e, KvStored) and e.tier == Tier.DEVICE)
    host_removed = next(i for i, e in enumerate(after) if isinstance(e, KvRemoved) and e.tier == Tier.HOST)
    assert device_stored < host_removed and set(after[host_removed].block_hashes) == set(ca)
    assert bm.cached_prefix_blocks(ca) == 2 and bm.host_prefix_blocks(ca, 0) == 0  # one tier at a time


def test_a_full_host_tier_drops_its_oldest_blocks_for_good() -> None:
    bm, events = tiered(2, 2)
    a, b = list(range(8)), list(range(100, 108))
    run(bm, a)
    run(bm, b)  # a -> host (2 blocks, full)
    run(bm, list(range(200, 208)))  # b -> host: a's blocks leave for good
    assert bm.host_prefix_blocks(seq(a)[0], 0) == 0 and bm.host_prefix_blocks(seq(b)[0], 0) == 2
    dropped = [h for e in events if isinstance(e, KvRemoved) and e.tier == Tier.HOST for h in e.block_hashes]
    assert set(dropped) == set(seq(a)[0])
    assert bm.host_active_blocks == 2


def test_without_a_host_tier_nothing_moves() -> None:
    bm, events = tiered(4, 0)
    for base in (0, 100, 200, 0):
        run(bm, list(range(base, base + 8)))
    assert all(getattr(e, "tier", Tier.DEVICE) == Tier.DEVICE for e in events)
    assert bm.host_active_blocks == 0 and bm.host_hit_blocks == 0


def test_the_router_index_follows_the_mockers_events_across_tiers_and_a_snapshot_rebuilds_it() -> None:
    rng = random.Random(7)
    log, live = KvEventLog(), RadixTree()

    def sink(data: KvEventData) -> None:
        log.append(data)
        apply_kv_event(live, "w", data)

    bm = BlockManager(10, BS, sink, 16)
    prompts = [[rng.randrange(10, 60) for _ in range(4 * BS)] for _ in range(12)]
    for _ in range(80):
        tokens = rng.choice(prompts)[: rng.randrange(1, 5) * BS] + [rng.randrange(60, 90) for _ in range(3)]
        run(bm, tokens)
    rebuilt = RadixTree()
    for event in log.snapshot():
        apply_kv_event(rebuilt, "w", event.data)
    assert bm.host_active_blocks and bm.host_hit_blocks  # both tiers were in play
    assert any(live.find_matches_by_tier(local_block_hashes(p, BS))[1] for p in prompts)
    for prompt in prompts:
        device, host = live.find_matches_by_tier(local_block_hashes(prompt, BS))
        chain = seq(prompt)[0]
        held = bm.cached_prefix_blocks(chain)
        assert device.get("w", 0) >= held
        assert (device, host) == rebuilt.find_matches_by_tier(local_block_hashes(prompt, BS))
        assert host.get("w", 0) >= bm.host_prefix_blocks(chain, held)


# -- what a host hit is worth -------------------------------------------------------------------

def load(us_per_token: float = 20.0, per_1k: float = 2.4, gbps: float = 50.0,
         kv_bytes_per_token: int = 131072) -> worker_pb2.LoadMetrics:
    return worker_pb2.LoadMetrics(
        kv_total_blocks=4096,
        host_tier=worker_pb2.HostKvTier(total_blocks=32768, load_gbps=gbps, kv_bytes_per_token=kv_bytes_per_token),
        prefill_cost=worker_pb2.PrefillCost(us_per_token=us_per_token, us_per_token_per_1k=per_1k))


def test_the_credit_is_what_loading_back_saves_against_recomputing() -> None:
    # 16 tokens of 128 KiB over 50 GB/s: 42 us; recomputing them at 20 us each: 320 us.
    credit = host_credit(load(per_1k=0.0), 0, 1, 16)
    assert credit == pytest.approx(1 - 16 * 131072 / 50e9 / (16 * 20e-6))


def test_the_credit_follows_prefix_length_link_and_model() -> None:
    short, deep = host_credit(load(), 0, 4, 16), host_credit(load(), 500, 4, 16)
    assert deep > short  # later tokens attend to more context: dearer to recompute
    assert host_credit(load(gbps=5.0), 0, 4, 16) < host_credit(load(gbps=50.0), 0, 4, 16)
    # A small model (little KV per token, cheap tokens) next to a large one on the same link.
    assert host_credit(load(us_per_token=2.0, kv_bytes_per_token=131072), 0, 4, 16) == 0.0
    assert 0 < host_credit(load(), 0, 4, 16) < 1


def test_a_fixed_weight_overrides_and_a_worker_without_a_profile_gets_the_fallback() -> None:
    assert host_credit(load(), 0, 4, 16, fixed_weight=0.75) == 0.75
    assert host_credit(load(), 0, 4, 16, fixed_weight=0.0) == 0.0
    assert host_credit(worker_pb2.LoadMetrics(), 0, 4, 16) == FALLBACK_CREDIT


def cand(worker: str, device: int, host: int = 0, credit: float = 0.0, usage: float = 0.1,
         waiting: int = 0) -> Candidate:
    return Candidate(worker, device, int(usage * 4096), 4096, waiting, usage, host_overlap_blocks=host,
                     host_credit=credit)


def test_a_worker_holding_the_conversation_in_host_memory_beats_one_that_must_recompute_it() -> None:
    credit = host_credit(load(), 0, 60, 16)
    picked = choose([cand("host", 0, 60, credit), cand("cold", 0)], 16, 1000, CostWeights(), random.Random(0))
    assert picked.worker_id == "host"


def test_an_idle_device_hit_beats_a_busy_host_hit() -> None:
    credit = host_credit(load(), 0, 60, 16)
    picked = choose([cand("device", 60, usage=0.1), cand("host", 0, 60, credit, usage=0.6, waiting=3)], 16, 1000,
                    CostWeights(), random.Random(0))
    assert picked.worker_id == "device"
