"""What the router and the replay tool need from a KV index, and nothing more, so the fast radix
tree and the naive reference model are interchangeable wherever an index is held or replayed.

An index mirrors every worker's prefix cache from its KV events, then scores a prompt by the
blocks each worker already holds. Both the scores and the event edge cases follow NVIDIA
Dynamo's `RadixTree`, so the same events give Dynamo's `find_matches` numbers.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Protocol, runtime_checkable

from services.mesh.hashing import LocalBlockHash, SequenceHash

# One stored block as a KV event carries it: its sequence hash and its local (tokens) hash.
StoredBlock = tuple[SequenceHash, LocalBlockHash]


class EventError(Exception):
    """An event the index could not (fully) apply; the index stays consistent."""


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
    """

    def store(self, worker: Hashable, parent_hash: SequenceHash | None, blocks: Iterable[StoredBlock]) -> int:
        """Applies a stored event; returns the number of blocks applied."""
        ...

    def remove(self, worker: Hashable, block_hashes: Iterable[SequenceHash]) -> int:
        """Applies a removed event; returns how many of the named blocks the worker held."""
        ...

    def clear(self, worker: Hashable) -> None:
        """Applies a cleared event."""
        ...

    def remove_worker(self, worker: Hashable) -> None:
        """Forgets a worker and every block it held."""
        ...

    def find_matches(self, local_hashes: Sequence[LocalBlockHash]) -> dict[Hashable, int]:
        """Per worker, the number of matched levels (walking from the root) that it holds."""
        ...

    def block_count(self, worker: Hashable | None = None) -> int:
        """Blocks the worker holds by sequence hash (all workers' added up when None)."""
        ...
