"""The radix tree must score exactly as the naive reference index does after any event stream:
the reference states Dynamo's RadixTree semantics plainly enough to be checked by reading.

The property tests are derandomized (their examples follow from the test itself), so a failure
here fails the same way on every run and machine, and block hashes come from the mesh's own
xxh3 chaining, never from Python's per-process salted `hash()`.
"""

from __future__ import annotations

import inspect
from functools import cache

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.budget import examples

from services.routing.kv_index import KvIndex
from services.routing.radix_tree import EventError, RadixTree
from services.routing.reference_index import ReferenceIndex
from services.kv_protocol.hashing import LocalBlockHash, SequenceHash, chain_from
from services.kv_protocol.tier import Tier

WORKERS = list(range(6))
ALPHABET = st.integers(min_value=1, max_value=3)  # few local hashes: many shared prefixes and hits
PATHS = st.lists(ALPHABET, min_size=1, max_size=4)


@cache  # a small alphabet of short paths: a few hundred distinct ones
def block_hash(path: tuple[int, ...]) -> SequenceHash:
    """Engine-style sequence hash: the same prefix gives the same block hash on every worker."""
    return chain_from([LocalBlockHash(t) for t in path])[-1]


@st.composite
def events(draw, odd_hashes: bool = True):  # noqa: ANN001, ANN201
    kind = draw(st.sampled_from(["store", "store", "store", "remove", "clear", "remove_worker"]))
    worker = draw(st.sampled_from(WORKERS))
    if kind == "store":
        path = tuple(draw(PATHS))
        split = draw(st.integers(0, len(path) - 1))
        parent = block_hash(path[:split]) if split else None
        if draw(st.integers(0, 9)) == 0:
            parent = draw(st.integers(1, 50))  # a parent the worker may not hold
        blocks = [(block_hash(path[: i + 1]), path[i]) for i in range(split, len(path))]
        if odd_hashes and draw(st.integers(0, 14)) == 0 and blocks:
            blocks[-1] = (draw(st.integers(1, 50)), blocks[-1][1])  # an odd engine hash
        return ("store", worker, parent, blocks)
    if kind == "remove":
        # Some single blocks, some whole chains (tail first, as engines evict).
        path = tuple(draw(PATHS))
        chain = [block_hash(path[: i + 1]) for i in range(len(path))]
        picked = draw(st.sampled_from([chain[-1:], chain[:1], chain[::-1]]))
        return ("remove", worker, picked)
    return (kind, worker)


@st.composite
def tiered_events(draw):  # noqa: ANN001, ANN201
    """Events as above, each stored or removed one in a drawn tier (device or host memory)."""
    event = draw(events())
    if event[0] in ("store", "remove"):
        return (*event, draw(st.sampled_from([Tier.DEVICE, Tier.HOST])))
    return event


def apply(tree, event) -> None:  # noqa: ANN001
    kind, worker, *rest = event
    if kind == "store":
        try:
            tree.store(worker, *rest)
        except EventError:
            pass
    elif kind == "remove":
        tree.remove(worker, *rest)
    elif kind == "clear":
        tree.clear(worker)
    else:
        tree.remove_worker(worker)


@settings(max_examples=examples(1500), deadline=None, derandomize=True, database=None)
@given(st.lists(events(), max_size=60), st.lists(PATHS, min_size=1, max_size=12))
def test_scores_equal_the_reference_model_after_any_event_stream(stream, queries) -> None:  # noqa: ANN001
    assert_same_after(stream, queries)


def assert_same_after(stream, queries) -> None:  # noqa: ANN001
    """Both indexes fed `stream`: equal scores, per tier too, and equal block counts."""
    fast, ref = RadixTree(), ReferenceIndex()
    for event in stream:
        apply(fast, event)
        apply(ref, event)
    for query in queries:
        assert fast.find_matches(query) == ref.find_matches(query), (stream, query)
        assert fast.find_matches_by_tier(query) == ref.find_matches_by_tier(query), (stream, query)
    for worker in WORKERS:
        assert fast.block_count(worker) == ref.block_count(worker), (stream, worker)
    assert fast.block_count() == ref.block_count()


@settings(max_examples=examples(800), deadline=None, derandomize=True, database=None)
@given(st.lists(tiered_events(), max_size=60), st.lists(PATHS, min_size=1, max_size=12))
def test_scores_per_tier_equal_the_reference_model_after_any_event_stream(stream, queries) -> None:  # noqa: ANN001
    assert_same_after(stream, queries)


def test_a_block_moved_to_host_memory_scores_apart_and_keeps_what_hangs_below_it() -> None:
    for index in (RadixTree(), ReferenceIndex()):
        index.store("a", None, [(101, 1), (102, 2), (103, 3)])
        # Evicted tail first, each stored in host memory before the device lets go of it.
        index.store("a", 102, [(103, 3)], Tier.HOST)
        index.remove("a", [103])
        index.store("a", 101, [(102, 2)], Tier.HOST)
        index.remove("a", [102])
        assert index.find_matches_by_tier([1, 2, 3]) == ({"a": 1}, {"a": 2}), type(index).__name__
        assert index.find_matches([1, 2, 3]) == {"a": 1}
        # The device takes the prefix back: a level held in both tiers is a device hit.
        index.store("a", 101, [(102, 2)])
        assert index.find_matches_by_tier([1, 2, 3]) == ({"a": 2}, {"a": 1})
        index.remove_worker("a")
        assert index.find_matches_by_tier([1, 2, 3]) == ({}, {}) and index.block_count() == 0


def test_both_indexes_implement_the_whole_kv_index_protocol() -> None:
    # Both subclass KvIndex, so `isinstance` holds whatever they define: a method one of them
    # forgot would be the protocol's `...` stub, answering None. Each must define its own, with
    # the protocol's parameters.
    methods = {name: f for name, f in vars(KvIndex).items() if inspect.isfunction(f) and not name.startswith("_")}
    assert "find_matches" in methods and "store" in methods
    for cls in (RadixTree, ReferenceIndex):
        for name, stub in methods.items():
            own = getattr(cls, name)
            assert own is not stub, f"{cls.__name__}.{name} is the protocol's stub"
            assert list(inspect.signature(own).parameters) == list(inspect.signature(stub).parameters), \
                f"{cls.__name__}.{name}"


def test_the_reference_refuses_a_store_under_an_unknown_parent_as_the_tree_does() -> None:
    for index in (RadixTree(), ReferenceIndex()):
        try:
            index.store("a", 999, [(1, 1)])
            raise AssertionError(f"expected EventError from {type(index).__name__}")
        except EventError:
            pass
        assert index.find_matches([1]) == {} and index.block_count("a") == 0


def test_a_shared_prefix_scores_each_worker_by_its_matched_levels() -> None:
    tree = RadixTree()
    tree.store("a", None, [(101, 1), (102, 2), (103, 3)])
    tree.store("b", None, [(101, 1), (102, 2)])
    tree.store("b", 102, [(204, 4)])
    assert tree.find_matches([1, 2, 3]) == {"a": 3, "b": 2}
    assert tree.find_matches([1, 2, 4]) == {"a": 2, "b": 3}
    assert tree.find_matches([9]) == {}


def test_store_under_an_unknown_parent_is_skipped_with_an_error() -> None:
    tree = RadixTree()
    try:
        tree.store("a", 999, [(1, 1)])
        raise AssertionError("expected EventError")
    except EventError:
        pass
    assert tree.find_matches([1]) == {}


def test_removing_a_worker_drops_its_blocks_and_frees_its_slot_for_a_newcomer() -> None:
    tree = RadixTree()
    tree.store("a", None, [(1, 1), (2, 2)])
    tree.store("b", None, [(1, 1)])
    tree.remove_worker("a")
    assert tree.find_matches([1, 2]) == {"b": 1}
    tree.store("c", None, [(1, 1), (2, 2)])
    assert tree.find_matches([1, 2]) == {"b": 1, "c": 2}
    assert tree.block_count("a") == 0 and tree.block_count() == 3


def test_an_emptied_block_drops_everything_below_it_as_dynamo_does() -> None:
    tree = RadixTree()
    tree.store("a", None, [(1, 1), (2, 2)])
    tree.remove("a", [1])
    assert tree.find_matches([1, 2]) == {}
    tree.store("b", None, [(1, 1), (2, 2)])
    assert tree.find_matches([1, 2]) == {"b": 2}


def both(*events) -> tuple[RadixTree, ReferenceIndex]:  # noqa: ANN002
    fast, ref = RadixTree(), ReferenceIndex()
    for event in events:
        apply(fast, event)
        apply(ref, event)
    return fast, ref


def test_a_detached_block_is_reattached_with_the_workers_it_still_has() -> None:
    fast, ref = both(
        ("store", "a", None, [(11, 1), (12, 2)]),
        ("store", "b", None, [(11, 1), (12, 2)]),
        ("remove", "a", [11]),
        ("remove", "b", [11]),  # block 1 is empty: block 2 (still held by a and b) is cut off
        ("store", "a", None, [(11, 1), (12, 2)]),  # a's lookup still has block 2: it is re-attached
    )
    assert fast.find_matches([1, 2]) == ref.find_matches([1, 2]) == {"a": 2, "b": 1}


def test_a_stale_mark_of_a_removed_worker_never_counts_for_a_newcomer() -> None:
    fast, ref = both(
        ("store", "a", None, [(11, 1)]),
        ("store", "a", None, [(21, 2)]),
        ("store", "a", None, [(11, 2)]),  # hash 11 now names the tokens-2 block: the tokens-1 one is stale
        ("remove_worker", "a"),
        ("store", "c", None, [(31, 3)]),
    )
    assert fast.find_matches([1]) == ref.find_matches([1]) == {"a": 1}
    assert fast.find_matches([3]) == ref.find_matches([3]) == {"c": 1}


@settings(max_examples=examples(500), deadline=None, derandomize=True, database=None)
@given(st.lists(events(odd_hashes=False), max_size=60))
def test_nodes_are_freed_once_no_worker_or_parent_references_them(stream) -> None:  # noqa: ANN001
    # With engine hashes that name one block each (as real engines' do). A hash reused for other
    # tokens links one node under two parents, as in Dynamo; such a node is kept until its
    # parents go (see radix_tree.py).
    tree = RadixTree()
    for event in stream:
        apply(tree, event)
    for worker in WORKERS:
        tree.remove_worker(worker)
    assert tree.node_count() == 1  # the root
    assert tree.block_count() == 0 and tree.find_matches([1, 2, 3]) == {}


def test_an_evicted_conversation_frees_its_nodes_but_keeps_the_shared_prefix() -> None:
    tree = RadixTree()
    tree.store("a", None, [(1, 1), (2, 2)])
    tree.store("a", 2, [(3, 3), (4, 4)])
    tree.store("b", None, [(1, 1), (2, 2)])
    assert tree.node_count() == 5
    tree.remove("a", [4, 3, 2, 1])
    assert tree.node_count() == 3
    assert tree.find_matches([1, 2, 3, 4]) == {"b": 2}
