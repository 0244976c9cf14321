"""The radix trees (the Python one and the native one in C) must score exactly as the naive
reference index does after any event stream: the reference states Dynamo's RadixTree semantics
plainly enough to be checked by reading. Each test runs on both trees (`fast_index`); the native
one is skipped, saying so, where it was not built (or is stale), and fails there instead under
KVMESH_REQUIRE_NATIVE=1 (`make test` and `make test-unit` set it, so CI proves it builds).

The property tests are derandomized (their examples follow from the test itself), so a failure
here fails the same way on every run and machine, and block hashes come from the mesh's own
xxh3 chaining, never from Python's per-process salted `hash()`.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from functools import cache
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.budget import examples

from services.routing.kv_index import EventErrorKind, KvIndex
from services.routing.radix_tree import EventError, RadixTree
from services.routing.reference_index import ReferenceIndex
from services.kv_protocol.hashing import LocalBlockHash, SequenceHash, chain_from
from services.kv_protocol.tier import Tier

REQUIRE_NATIVE = os.environ.get("KVMESH_REQUIRE_NATIVE") == "1"
try:
    from services.routing.native.native_radix_tree import NativeRadixTree
    NATIVE_MISSING = ""
except ImportError as exc:  # not built or stale: the router falls back to RadixTree (index_choice.py)
    NATIVE_MISSING = f"the native index does not import ({exc}); build it with `python -m services.routing.native.build`"


def native_index() -> KvIndex:
    if NATIVE_MISSING:  # reached only under KVMESH_REQUIRE_NATIVE=1: the test is skipped otherwise
        pytest.fail(f"KVMESH_REQUIRE_NATIVE=1, but {NATIVE_MISSING}", pytrace=False)
    return NativeRadixTree()


FAST_INDEXES = [
    pytest.param(RadixTree, id="python"),
    pytest.param(native_index, id="native", marks=pytest.mark.skipif(
        bool(NATIVE_MISSING) and not REQUIRE_NATIVE, reason=f"{NATIVE_MISSING} (KVMESH_REQUIRE_NATIVE=1 fails instead)")),
]
fast_indexes = pytest.mark.parametrize("fast_index", FAST_INDEXES)
Factory = Callable[[], KvIndex]

WORKERS = list(range(6))
ALPHABET = st.integers(min_value=1, max_value=3)  # few local hashes: many shared prefixes and hits
PATHS = st.lists(ALPHABET, min_size=1, max_size=4)


@cache  # a small alphabet of short paths: a few hundred distinct ones
def block_hash(path: tuple[int, ...]) -> SequenceHash:
    """Engine-style sequence hash: the same prefix gives the same block hash on every worker."""
    return chain_from([LocalBlockHash(t) for t in path])[-1]


@st.composite
def events(draw, odd_hashes: bool = True, workers: list[int] = WORKERS):  # noqa: ANN001, ANN201
    kind = draw(st.sampled_from(["store", "store", "store", "remove", "clear", "remove_worker"]))
    worker = draw(st.sampled_from(workers))
    if kind == "store":
        path = tuple(draw(PATHS))
        split = draw(st.integers(0, len(path) - 1))
        parent = block_hash(path[:split]) if split else None
        if draw(st.integers(0, 9)) == 0:
            parent = draw(st.integers(1, 50))  # a parent the worker may not hold
        blocks = [(block_hash(path[: i + 1]), path[i]) for i in range(split, len(path))]
        if odd_hashes and draw(st.integers(0, 14)) == 0 and blocks:
            blocks[-1] = (draw(st.integers(1, 50)), blocks[-1][1])  # an odd engine hash
        if draw(st.integers(0, 11)) == 0:
            # A block reusing the hash of the block it hangs under (the parent's, or the previous
            # block's): it would become its own child, so the store stops there (CONTRADICTS_TREE).
            at = draw(st.integers(0, len(blocks) - 1))
            above = blocks[at - 1][0] if at else parent
            if above is not None:
                blocks[at] = (above, blocks[at][1])
        return ("store", worker, parent, blocks)
    if kind == "remove":
        # Some single blocks, some whole chains (tail first, as engines evict).
        path = tuple(draw(PATHS))
        chain = [block_hash(path[: i + 1]) for i in range(len(path))]
        picked = draw(st.sampled_from([chain[-1:], chain[:1], chain[::-1]]))
        return ("remove", worker, picked)
    return (kind, worker)


@st.composite
def tiered_events(draw, workers: list[int] = WORKERS):  # noqa: ANN001, ANN201
    """Events as above, each stored or removed one in a drawn tier (device or host memory)."""
    event = draw(events(workers=workers))
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


@fast_indexes
@settings(max_examples=examples(1500), deadline=None, derandomize=True, database=None)
@given(st.lists(events(), max_size=60), st.lists(PATHS, min_size=1, max_size=12))
def test_scores_equal_the_reference_model_after_any_event_stream(fast_index: Factory, stream, queries) -> None:  # noqa: ANN001
    assert_same_after(fast_index, stream, queries)


def assert_same_after(fast_index: Factory, stream, queries, workers=WORKERS) -> None:  # noqa: ANN001
    """Both indexes fed `stream`: equal scores, per tier too, and equal block counts."""
    fast, ref = fast_index(), ReferenceIndex()
    for event in stream:
        apply(fast, event)
        apply(ref, event)
    assert_no_self_links(ref, stream)  # the fast trees, scoring as it does, have none either
    for query in queries:
        assert fast.find_matches(query) == ref.find_matches(query), (stream, query)
        assert fast.find_matches_by_tier(query) == ref.find_matches_by_tier(query), (stream, query)
    for worker in workers:
        assert fast.block_count(worker) == ref.block_count(worker), (stream, worker)
    assert fast.block_count() == ref.block_count()


def assert_no_self_links(ref: ReferenceIndex, stream) -> None:  # noqa: ANN001
    """No node of the reference is its own child: a query repeating that block's hash would score
    it at every repetition."""
    seen, todo = {id(ref.root)}, [ref.root]
    while todo:
        node = todo.pop()
        for child in node.children.values():
            assert child is not node, stream
            if id(child) not in seen:
                seen.add(id(child))
                todo.append(child)


@fast_indexes
@settings(max_examples=examples(800), deadline=None, derandomize=True, database=None)
@given(st.lists(tiered_events(), max_size=60), st.lists(PATHS, min_size=1, max_size=12))
def test_scores_per_tier_equal_the_reference_model_after_any_event_stream(fast_index: Factory, stream, queries) -> None:  # noqa: ANN001
    assert_same_after(fast_index, stream, queries)


@fast_indexes
def test_a_block_moved_to_host_memory_scores_apart_and_keeps_what_hangs_below_it(fast_index: Factory) -> None:
    for index in (fast_index(), ReferenceIndex()):
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
    for cls in (RadixTree, ReferenceIndex, *(() if NATIVE_MISSING else (NativeRadixTree,))):
        for name, stub in methods.items():
            own = getattr(cls, name)
            assert own is not stub, f"{cls.__name__}.{name} is the protocol's stub"
            assert list(inspect.signature(own).parameters) == list(inspect.signature(stub).parameters), \
                f"{cls.__name__}.{name}"


@fast_indexes
def test_the_reference_refuses_a_store_under_an_unknown_parent_as_the_tree_does(fast_index: Factory) -> None:
    for index in (fast_index(), ReferenceIndex()):
        try:
            index.store("a", 999, [(1, 1)])
            raise AssertionError(f"expected EventError from {type(index).__name__}")
        except EventError:
            pass
        assert index.find_matches([1]) == {} and index.block_count("a") == 0


@fast_indexes
def test_a_shared_prefix_scores_each_worker_by_its_matched_levels(fast_index: Factory) -> None:
    tree: Any = fast_index()
    tree.store("a", None, [(101, 1), (102, 2), (103, 3)])
    tree.store("b", None, [(101, 1), (102, 2)])
    tree.store("b", 102, [(204, 4)])
    assert tree.find_matches([1, 2, 3]) == {"a": 3, "b": 2}
    assert tree.find_matches([1, 2, 4]) == {"a": 2, "b": 3}
    assert tree.find_matches([9]) == {}


@fast_indexes
def test_store_under_an_unknown_parent_is_skipped_with_an_error(fast_index: Factory) -> None:
    tree: Any = fast_index()
    try:
        tree.store("a", 999, [(1, 1)])
        raise AssertionError("expected EventError")
    except EventError:
        pass
    assert tree.find_matches([1]) == {}


@fast_indexes
def test_removing_a_worker_drops_its_blocks_and_frees_its_slot_for_a_newcomer(fast_index: Factory) -> None:
    tree: Any = fast_index()
    tree.store("a", None, [(1, 1), (2, 2)])
    tree.store("b", None, [(1, 1)])
    tree.remove_worker("a")
    assert tree.find_matches([1, 2]) == {"b": 1}
    tree.store("c", None, [(1, 1), (2, 2)])
    assert tree.find_matches([1, 2]) == {"b": 1, "c": 2}
    assert tree.block_count("a") == 0 and tree.block_count() == 3


@fast_indexes
def test_an_emptied_block_drops_everything_below_it_as_dynamo_does(fast_index: Factory) -> None:
    tree: Any = fast_index()
    tree.store("a", None, [(1, 1), (2, 2)])
    tree.remove("a", [1])
    assert tree.find_matches([1, 2]) == {}
    tree.store("b", None, [(1, 1), (2, 2)])
    assert tree.find_matches([1, 2]) == {"b": 2}


def both(fast_index: Factory, *events) -> tuple[KvIndex, ReferenceIndex]:  # noqa: ANN002
    fast, ref = fast_index(), ReferenceIndex()
    for event in events:
        apply(fast, event)
        apply(ref, event)
    return fast, ref


@fast_indexes
def test_a_detached_block_is_reattached_with_the_workers_it_still_has(fast_index: Factory) -> None:
    fast, ref = both(
        fast_index,
        ("store", "a", None, [(11, 1), (12, 2)]),
        ("store", "b", None, [(11, 1), (12, 2)]),
        ("remove", "a", [11]),
        ("remove", "b", [11]),  # block 1 is empty: block 2 (still held by a and b) is cut off
        ("store", "a", None, [(11, 1), (12, 2)]),  # a's lookup still has block 2: it is re-attached
    )
    assert fast.find_matches([1, 2]) == ref.find_matches([1, 2]) == {"a": 2, "b": 1}


@fast_indexes
def test_a_stale_mark_of_a_removed_worker_never_counts_for_a_newcomer(fast_index: Factory) -> None:
    fast, ref = both(
        fast_index,
        ("store", "a", None, [(11, 1)]),
        ("store", "a", None, [(21, 2)]),
        ("store", "a", None, [(11, 2)]),  # hash 11 now names the tokens-2 block: the tokens-1 one is stale
        ("remove_worker", "a"),
        ("store", "c", None, [(31, 3)]),
    )
    assert fast.find_matches([1]) == ref.find_matches([1]) == {"a": 1}
    assert fast.find_matches([3]) == ref.find_matches([3]) == {"c": 1}


@fast_indexes
@settings(max_examples=examples(500), deadline=None, derandomize=True, database=None)
@given(st.lists(events(odd_hashes=False), max_size=60))
def test_nodes_are_freed_once_no_worker_or_parent_references_them(fast_index: Factory, stream) -> None:  # noqa: ANN001
    # With engine hashes that name one block each (as real engines' do). A hash reused for other
    # tokens links one node under two parents, as in Dynamo; such a node is kept until its
    # parents go (see radix_tree.py).
    tree: Any = fast_index()
    for event in stream:
        apply(tree, event)
    for worker in WORKERS:
        tree.remove_worker(worker)
    assert tree.node_count() == 1  # the root
    assert tree.block_count() == 0 and tree.find_matches([1, 2, 3]) == {}


@fast_indexes
def test_an_evicted_conversation_frees_its_nodes_but_keeps_the_shared_prefix(fast_index: Factory) -> None:
    tree: Any = fast_index()
    tree.store("a", None, [(1, 1), (2, 2)])
    tree.store("a", 2, [(3, 3), (4, 4)])
    tree.store("b", None, [(1, 1), (2, 2)])
    assert tree.node_count() == 5
    tree.remove("a", [4, 3, 2, 1])
    assert tree.node_count() == 3
    assert tree.find_matches([1, 2, 3, 4]) == {"b": 2}


MANY_WORKERS = list(range(80))  # 160 holders with both tiers: past any 64-bit mask


@fast_indexes
@settings(max_examples=examples(300), deadline=None, derandomize=True, database=None)
@given(st.lists(tiered_events(workers=MANY_WORKERS), max_size=200), st.lists(PATHS, min_size=1, max_size=12))
def test_scores_equal_the_reference_model_with_more_than_64_holders(fast_index: Factory, stream, queries) -> None:  # noqa: ANN001
    assert_same_after(fast_index, stream, queries, MANY_WORKERS)


@fast_indexes
def test_a_hundred_workers_on_one_prefix_each_score_and_leave_nothing_behind(fast_index: Factory) -> None:
    tree: Any = fast_index()
    for w in range(100):
        tree.store(w, None, [(11, 1), (12, 2)])
        tree.store(w, 11, [(12, 2)], Tier.HOST)
    assert tree.find_matches([1, 2]) == {w: 2 for w in range(100)}
    assert tree.find_matches_by_tier([1, 2]) == ({w: 2 for w in range(100)}, {})
    for w in range(0, 100, 2):
        tree.remove(w, [12])
    assert tree.find_matches_by_tier([1, 2]) == ({w: 2 - w % 2 * 0 - (w + 1) % 2 for w in range(100)},
                                                 {w: 1 for w in range(0, 100, 2)})
    for w in range(100):
        tree.remove_worker(w)
    assert tree.find_matches([1, 2]) == {} and tree.block_count() == 0 and tree.node_count() == 1


# Each kind of event error, as an engine's events make it, and what the index keeps of that event.
ERROR_CASES = [
    pytest.param([("a", 999, [(1, 1)])], EventErrorKind.UNKNOWN_PARENT, [1], {}, id="unknown_parent"),
    pytest.param([("a", None, [(1, 1)]), ("a", 1, [(7, 7), (7, 8)])], EventErrorKind.CONTRADICTS_TREE, [1, 7, 8, 8],
                 {"a": 2}, id="contradicts_tree"),
    pytest.param([("a", None, [(1, 1)]), ("a", 1, [(1, 2)])], EventErrorKind.CONTRADICTS_TREE, [1, 2, 2, 2, 2, 2],
                 {"a": 1}, id="contradicts_tree_under_its_parent"),
    pytest.param([("a", None, [(1, 1), (1 << 64, 2)])], EventErrorKind.BAD_HASH, [1, 2], {"a": 1}, id="bad_block_hash"),
    pytest.param([("a", None, [(1, 1), (2, -2)])], EventErrorKind.BAD_HASH, [1, 2], {"a": 1}, id="bad_tokens_hash"),
]


@fast_indexes
@pytest.mark.parametrize(("stores", "kind", "query", "scores"), ERROR_CASES)
def test_each_event_error_has_its_kind_and_keeps_the_blocks_before_it(fast_index: Factory, stores, kind, query,  # noqa: ANN001
                                                                      scores) -> None:  # noqa: ANN001
    index = fast_index()
    *before, last = stores
    for event in before:
        index.store(*event)
    with pytest.raises(EventError) as raised:
        index.store(*last)
    assert raised.value.kind is kind
    assert index.find_matches(query) == scores
    assert index.block_count("a") == sum(scores.values())


@fast_indexes
def test_a_block_that_would_be_its_own_child_is_never_linked_and_all_three_indexes_agree(fast_index: Factory) -> None:
    fast, ref = both(
        fast_index,
        ("store", "w", None, [(1, 1)]),
        ("store", "w", 1, [(1, 2)]),  # block 1 under itself: refused before it is linked
        ("store", "v", None, [(1, 1), (5, 5)]),
        ("store", "v", 5, [(6, 6), (6, 7), (8, 8)]),  # block 6 under block 6: 6 is kept, 7 and 8 are not
    )
    for index in (fast, ref):
        assert index.find_matches([1, 2, 2, 2, 2, 2]) == {"w": 1, "v": 1}, type(index).__name__
        assert index.find_matches([1, 5, 6, 7, 7, 8]) == {"w": 1, "v": 3}, type(index).__name__
        assert index.block_count("w") == 1 and index.block_count("v") == 3
        index.remove_worker("w")
        index.remove_worker("v")
        assert index.find_matches([1, 5, 6]) == {} and index.block_count() == 0
    assert fast.node_count() == 1  # type: ignore[attr-defined]


@fast_indexes
def test_a_returning_worker_takes_back_its_stale_marks_and_lets_go_of_them_when_removed_again(fast_index: Factory) -> None:
    fast, ref = both(
        fast_index,
        ("store", 0, None, [(11, 2), (12, 2), (13, 2)]),
        ("store", 2, None, [(11, 2), (11, 2), (20, 1)]),  # hash 11 moves to the second level: a stale mark on the first
        ("remove_worker", 2),
        ("store", 2, None, [(11, 2), (30, 1)]),
        ("remove_worker", 2),
    )
    for index in (fast, ref):
        assert index.find_matches([2, 2, 2]) == {0: 3}, type(index).__name__
        assert index.find_matches([2, 1]) == {0: 1}, type(index).__name__
        index.remove_worker(0)
        assert index.find_matches([2, 2]) == {} and index.block_count() == 0, type(index).__name__
    assert fast.node_count() == 1  # type: ignore[attr-defined]


def test_the_native_index_imports_where_it_is_required() -> None:
    if not REQUIRE_NATIVE:
        pytest.skip("KVMESH_REQUIRE_NATIVE is not 1")
    assert not NATIVE_MISSING, NATIVE_MISSING


def test_a_native_build_that_does_not_import_is_a_warning_and_a_missing_one_is_not(monkeypatch, caplog, tmp_path) -> None:  # noqa: ANN001
    import logging
    import sys

    from services.routing import index_choice
    from services.routing.native import build

    monkeypatch.delenv("KVMESH_INDEX", raising=False)
    monkeypatch.setitem(sys.modules, "services.routing.native.native_radix_tree", None)  # its import fails
    stale = tmp_path / "_kvtree.so"
    stale.write_bytes(b"")
    for built, level in ((stale, logging.WARNING), (tmp_path / "missing.so", logging.INFO)):
        monkeypatch.setattr(build, "target", lambda built=built: built)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=index_choice.__name__):
            assert type(index_choice.new_index()) is RadixTree
        assert [r.levelno for r in caplog.records] == [level], caplog.text


def test_the_router_holds_the_native_index_where_it_was_built_and_python_when_told(monkeypatch) -> None:  # noqa: ANN001
    from services.routing.index_choice import new_index

    monkeypatch.setenv("KVMESH_INDEX", "python")
    assert type(new_index()) is RadixTree
    monkeypatch.delenv("KVMESH_INDEX")
    assert type(new_index()) is (RadixTree if NATIVE_MISSING else NativeRadixTree)
