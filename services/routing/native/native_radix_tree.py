"""`NativeRadixTree`: the `KvIndex` protocol over the C tree (`_kvtree.Tree`, kvtree.c).

Everything happens in C: this class names the protocol's methods and turns a `Tier` into the
C side's host flag. The C tree raises `EventError` with the same kinds as the Python one, given
to it once at import.

Memory (the C tree's layout, tree_core.h and block_map.h): a node is 28 bytes (its local hash,
a 64-bit holder mask, its child or child map, its parent, its reference count); each holder's
blocks are a table of packed 12-byte (sequence hash, node) entries kept half to three quarters
full (16 to 24 bytes an entry). A held block costs its entry plus, where no other holder shares
its node, the node: about 28 + 20 = 48 bytes, less where workers share prefixes. Holders past 64
add 8 bytes per node per 64.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from services.kv_protocol.hashing import LocalBlockHash, SequenceHash
from services.kv_protocol.tier import Tier
from services.routing.kv_index import EventError, EventErrorKind, KvIndex, StoredBlock
from services.routing.native import _kvtree
from services.routing.native.build import sources_digest

if getattr(_kvtree, "SOURCES", None) != sources_digest():  # a build from before the digest: stale too
    raise ImportError("the native index was built from older sources: run `make install` (or "
                      "`python -m services.routing.native.build`) again")
_kvtree.configure(EventError, EventErrorKind.UNKNOWN_PARENT, EventErrorKind.CONTRADICTS_TREE, EventErrorKind.BAD_HASH)


class NativeRadixTree(KvIndex):
    __slots__ = ("_tree",)

    def __init__(self) -> None:
        self._tree = _kvtree.Tree()

    def store(self, worker: Hashable, parent_hash: SequenceHash | None, blocks: Iterable[StoredBlock],
              tier: Tier = Tier.DEVICE) -> int:
        """Applies a stored event; returns the number of blocks applied."""
        return self._tree.store(worker, parent_hash, blocks, tier == Tier.HOST)

    def remove(self, worker: Hashable, block_hashes: Iterable[SequenceHash], tier: Tier = Tier.DEVICE) -> int:
        """Applies a removed event; unknown blocks are skipped. Returns the number removed."""
        return self._tree.remove(worker, block_hashes, tier == Tier.HOST)

    def clear(self, worker: Hashable) -> None:
        """Applies a cleared event: the worker holds nothing in either tier, but stays known."""
        self._tree.clear(worker)

    def remove_worker(self, worker: Hashable) -> None:
        """Forgets a worker (its lease is gone): all its blocks in both tiers."""
        self._tree.remove_worker(worker)

    def find_matches(self, local_hashes: Sequence[LocalBlockHash]) -> dict[Hashable, int]:
        """Per worker, the number of matched levels (walking from the root) its device holds."""
        return self._tree.find_matches(local_hashes)

    def find_matches_by_tier(self, local_hashes: Sequence[LocalBlockHash]
                             ) -> tuple[dict[Hashable, int], dict[Hashable, int]]:
        """`find_matches`, and per worker the matched levels held in its host tier only."""
        return self._tree.find_matches_by_tier(local_hashes)

    def block_count(self, worker: Hashable | None = None) -> int:
        """Blocks the worker's device holds (every holder's, both tiers, when None)."""
        return self._tree.block_count(worker)

    def node_count(self) -> int:
        """Live nodes, the root included."""
        return self._tree.node_count()
