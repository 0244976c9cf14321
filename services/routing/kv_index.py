"""What the router and the replay tool need from a KV index, and nothing more, so the fast radix
tree and the naive reference model are interchangeable wherever an index is held or replayed.

An index mirrors every worker's prefix cache from its KV events, then scores a prompt by the
blocks each worker already holds. The scores and the event edge cases were designed after NVIDIA
Dynamo's `RadixTree`, and kvmesh keeps them (the reference model below states them); Dynamo 1.6.1
has since changed three of them, so the two agree on 1,890 of the indexer trace's 2,000 queries:
it scores a worker only along an unbroken prefix (a worker missing a middle level drops out where
kvmesh keeps counting the deeper levels it holds), a node that empties drops its lookup entries
below it (later removals of those blocks fail: it refuses about 8,000 of the trace's events), and
a removed event naming an unknown block is an error (the known ones are still removed).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol, runtime_checkable

from services.kv_protocol.events import KvEventData, KvRemoved, KvStored
from services.kv_protocol.hashing import LocalBlockHash, SequenceHash
from services.kv_protocol.tier import Tier

# One stored block as a KV event carries it: its sequence hash and its local (tokens) hash.
StoredBlock = tuple[SequenceHash, LocalBlockHash]


@dataclass(frozen=True, slots=True)
class HostCopy:
    """The index's name for a worker's host tier: a holder of its own beside the worker, so a
    node one tier holds keeps its children while the other tier lets go of it."""

    worker: Hashable


def holder(worker: Hashable, tier: Tier) -> Hashable:
    return worker if tier == Tier.DEVICE else HostCopy(worker)


class EventErrorKind(Enum):
    """Why an event could not be (fully) applied. Each kind is its own counter at the router
    (`kvmesh_router_kv_event_errors_total{kind}`): they have different causes and cures."""

    # A stored event hangs under a block the worker does not hold: an event before it was lost
    # (or the router missed the worker's restart). The store is skipped whole.
    UNKNOWN_PARENT = "unknown_parent"
    # A removed event names a block the worker does not hold: a store was lost, or the removal
    # came twice. Those names are skipped (the index's `remove` returns how many it did remove).
    UNKNOWN_BLOCK = "unknown_block"
    # A stored sequence contradicts the tree: a block would become its own child. The rest of the
    # store is skipped.
    CONTRADICTS_TREE = "contradicts_tree"
    # A block hash is not a 64-bit unsigned int: the engine's hashing disagrees with the wire.
    # The rest of the store is skipped.
    BAD_HASH = "bad_hash"


class EventError(Exception):
    """An event the index could not (fully) apply; the index stays consistent. `kind` says why."""

    def __init__(self, kind: EventErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@runtime_checkable
class KvIndex(Protocol):
    """A tree of blocks keyed by local block hash, each node holding the set of workers that
    cache it; a path from the root is a prompt prefix.

    Scoring: walk from the root along the prompt's local block hashes, one level per block,
    for as long as the current node has a child under the next hash. A worker's score is the
    number of levels on that walk whose node the worker holds. Workers with no such level are
    absent from the result (not scored 0). The walk does not stop at a level a worker lacks:
    a worker that lost a middle block still scores the deeper levels it holds.

    Events (`worker` is any hashable worker id; sequence hashes are per worker):
    - stored: the blocks hang under the worker's block with sequence hash `parent_hash` (under
      the root when it is None), each under the previous one. A stored event whose parent the
      worker does not hold is skipped whole and raises `EventError`. Where the parent has a
      child under the block's local hash, the worker joins that node. Otherwise a block hash
      the worker already has is re-attached: its existing node, with every worker still on
      it, is linked under the parent rather than duplicated. A block that would become its
      own child stops the event there, raising `EventError` after the blocks before it.
    - removed: the worker stops holding each named block; names it does not hold are skipped.
      A node left with no worker drops its children, whoever holds them: engines reuse a
      prompt's cache from its first block on, so blocks below a block no worker holds are of
      no use to any prompt.
    - cleared: the worker holds nothing, but stays known.
    - remove_worker: the worker's lease is gone: all its blocks, then the worker itself.

    Tiers: stored and removed events name the tier (device or host memory) that gains or loses
    the blocks. Each tier of a worker holds nodes as a holder of its own (`HostCopy` for the
    host), so a node held in either tier keeps its children; a host store's parent may be held
    in either tier (a block moves to host memory while its parent is still on the device), a
    device store's parent only on the device (an engine computes or loads a block back only after
    its prefix is on the device). `find_matches` scores the device tier alone (Dynamo's
    numbers); `find_matches_by_tier` adds, per worker, the levels held in host memory only.
    """

    def store(self, worker: Hashable, parent_hash: SequenceHash | None, blocks: Iterable[StoredBlock],
              tier: Tier = Tier.DEVICE) -> int:
        """Applies a stored event; returns the number of blocks applied."""
        ...

    def remove(self, worker: Hashable, block_hashes: Iterable[SequenceHash], tier: Tier = Tier.DEVICE) -> int:
        """Applies a removed event; returns how many of the named blocks the worker held."""
        ...

    def clear(self, worker: Hashable) -> None:
        """Applies a cleared event."""
        ...

    def remove_worker(self, worker: Hashable) -> None:
        """Forgets a worker and every block it held."""
        ...

    def find_matches(self, local_hashes: Sequence[LocalBlockHash]) -> dict[Hashable, int]:
        """Per worker, the number of matched levels (walking from the root) that its device holds."""
        ...

    def find_matches_by_tier(self, local_hashes: Sequence[LocalBlockHash]
                             ) -> tuple[dict[Hashable, int], dict[Hashable, int]]:
        """`find_matches`, and per worker the matched levels its host tier holds and its device
        does not."""
        ...

    def block_count(self, worker: Hashable | None = None) -> int:
        """Blocks the worker's device holds by sequence hash (every holder's, both tiers, added up
        when None)."""
        ...


def apply_kv_event(index: KvIndex, worker: Hashable, data: KvEventData) -> None:
    """Applies one event an engine emitted (in-process, as the mocker's block manager does) to
    the index, as the router applies the same event after the worker streams it."""
    if isinstance(data, KvStored):
        index.store(worker, data.parent_hash, data.blocks, data.tier)
    elif isinstance(data, KvRemoved):
        index.remove(worker, data.block_hashes, data.tier)
    else:
        index.clear(worker)
