"""The radix tree's compact parts against the reference index, where plain event streams rarely
go: block hashes that share their low bits (long probes that wrap past the table's end), tables
that grow and are laid out afresh while deleted pairs pile up, more holders than a 64-bit mask
holds, and hashes that do not fit 64 bits.
"""

from __future__ import annotations

import random

import pytest

from services.routing.block_table import GONE, BlockTable
from services.routing.kv_index import EventError
from services.routing.radix_tree import RadixTree
from services.routing.reference_index import ReferenceIndex
from tests.unit.budget import examples


def crowded_hash(k: int) -> int:
    """Distinct 64-bit hashes whose low 12 bits are all 0xABC: every one starts its probe at the
    same pair of any table up to 4,096 pairs, and the run wraps past the end."""
    return (k << 12) | 0xABC


def assert_same(fast: RadixTree, ref: ReferenceIndex, chains: list[list[int]], workers: list[int]) -> None:
    for chain in chains:
        assert fast.find_matches_by_tier(chain) == ref.find_matches_by_tier(chain), chain
    for worker in workers:
        assert fast.block_count(worker) == ref.block_count(worker), worker


def test_crowded_hashes_churned_through_growths_and_layouts_score_as_the_reference() -> None:
    rng = random.Random(7)
    fast, ref = RadixTree(), ReferenceIndex()
    workers = [0, 1, 2]
    chains = [[1000 + c * 10 + i for i in range(rng.randint(1, 12))] for c in range(300)]
    stored: dict[int, set[int]] = {w: set() for w in workers}
    for step in range(examples(6000)):
        worker = rng.choice(workers)
        c = rng.randrange(len(chains))
        chain = chains[c]
        hashes = [crowded_hash(c * 16 + i) for i in range(len(chain))]
        if rng.random() < 0.6:  # store a prefix of the chain whole, from the root
            n = rng.randint(1, len(chain))
            blocks = list(zip(hashes[:n], chain[:n], strict=True))
            assert fast.store(worker, None, blocks) == ref.store(worker, None, blocks)
            stored[worker].update(hashes[:n])
        else:  # evict a tail, tail first, as engines do
            picked = hashes[rng.randint(0, len(hashes) - 1):][::-1]
            assert fast.remove(worker, picked) == ref.remove(worker, picked)
            stored[worker].difference_update(picked)
        if step % 500 == 0:
            assert_same(fast, ref, chains, workers)
    assert_same(fast, ref, chains, workers)
    for worker in workers:
        table = fast._lookup[fast._slot_of[worker]]
        assert len(table) == len(stored[worker])
        assert sorted(table.get(h) > 0 for h in stored[worker]) == [True] * len(stored[worker])


def test_a_table_laid_out_afresh_keeps_every_live_entry_and_drops_the_deleted() -> None:
    table = BlockTable()
    table.reserve(600)
    live: dict[int, int] = {}
    for k in range(600):  # crowded: probes run long and wrap
        h = crowded_hash(k)
        i = table.find(h)
        table.pairs[i], table.pairs[i + 1] = h, k + 1
        live[h] = k + 1
    table.count = 600
    for h in list(live)[::3]:  # delete a third, as the tree does: the pair stays, marked gone
        table.pairs[table.find(h) + 1] = GONE
        table.count -= 1
        table.gone += 1
        del live[h]
    table.reserve(4000)  # grows: a layout
    assert table.gone == 0 and len(table) == len(live)
    assert all(table.get(h) == node for h, node in live.items())
    assert all(table.get(crowded_hash(k)) == 0 for k in range(0, 600, 3))
    assert sorted(table.held_nodes()) == sorted(live.values())


def test_more_holders_than_a_64_bit_mask_score_as_the_reference() -> None:
    fast, ref = RadixTree(), ReferenceIndex()
    chain = [11, 12, 13, 14]
    for worker in range(80):
        depth = 1 + worker % 4
        blocks = [(crowded_hash(worker * 8 + i), chain[i]) for i in range(depth)]
        fast.store(worker, None, blocks)
        ref.store(worker, None, blocks)
    assert_same(fast, ref, [chain], list(range(80)))
    assert len(fast.find_matches(chain)) == 80
    for worker in range(0, 80, 3):
        fast.remove_worker(worker)
        ref.remove_worker(worker)
    assert_same(fast, ref, [chain, chain[:2]], list(range(80)))


@pytest.mark.parametrize("bad", [1 << 64, -5])
def test_a_hash_that_does_not_fit_64_bits_is_refused_and_changes_nothing(bad: int) -> None:
    fast, ref = RadixTree(), ReferenceIndex()
    for index in (fast, ref):
        index.store("a", None, [(101, 1), (102, 2)])
        index.store("b", None, [(201, 1), (202, 3)])  # node 1 now has two children: one not inline
    with pytest.raises(EventError):
        fast.store("a", 102, [(bad, 5)])  # a block hash
    with pytest.raises(EventError):
        fast.store("a", 102, [(103, bad)])  # a local hash linked inline
    with pytest.raises(EventError):
        fast.store("c", None, [(301, 1), (302, bad)])  # a local hash beside other children
    ref.store("c", None, [(301, 1)])  # the blocks before the bad one stay applied
    for query in ([1, 2], [1, 3], [1, 2, 5], [1, 2, 4]):
        assert fast.find_matches(query) == ref.find_matches(query), query
    assert fast.block_count() == ref.block_count()
    # Still whole: later events apply as ever.
    for index in (fast, ref):
        index.store("a", 102, [(103, 4)])
    assert fast.find_matches([1, 2, 4]) == ref.find_matches([1, 2, 4]) == {"a": 3, "b": 1, "c": 1}
