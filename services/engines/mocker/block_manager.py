"""The mocker's paged KV cache: fixed-size blocks, prefix caching by chained hash, LRU eviction.

It behaves like vLLM's block pool where it matters to the router: a full block is cached under the
hash of its tokens and everything before it; blocks nobody references stay cached until space is
needed, and the least recently freed goes first. Every cache change is reported as a KV event.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from services.engines.base import KvEventData, KvRemoved, KvStored
from services.mesh.hashing import LocalBlockHash, SequenceHash

# Marks a block that caches nothing; sequence hashes are u64, never negative.
NO_HASH = SequenceHash(-1)


class BlockManager:
    __slots__ = (
        "_by_hash",
        "_emit",
        "_hash_of",
        "_lru",
        "_never_used",
        "_refs",
        "block_size",
        "num_blocks",
    )

    def __init__(self, num_blocks: int, block_size: int, emit: Callable[[KvEventData], None]) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._emit = emit
        self._never_used: list[int] = list(range(num_blocks - 1, -1, -1))
        self._by_hash: dict[SequenceHash, int] = {}
        self._hash_of: list[SequenceHash] = [NO_HASH] * num_blocks
        self._refs: list[int] = [0] * num_blocks
        # Cached blocks with no reference, oldest first: the eviction order.
        self._lru: OrderedDict[int, None] = OrderedDict()

    # -- queries -------------------------------------------------------------------------------

    @property
    def active_blocks(self) -> int:
        return self.num_blocks - len(self._never_used) - len(self._lru)

    @property
    def free_blocks(self) -> int:
        return len(self._never_used) + len(self._lru)

    def cached_prefix_blocks(self, chain: Sequence[SequenceHash]) -> int:
        n = 0
        for h in chain:
            if h not in self._by_hash:
                break
            n += 1
        return n

    # -- allocation ----------------------------------------------------------------------------

    def allocate(self, chain: list[SequenceHash], locals_: list[LocalBlockHash],
                 num_tokens: int) -> tuple[list[int], int] | None:
        """Blocks for a sequence of `num_tokens` whose full blocks hash to `chain`.

        Reuses the cached prefix, takes fresh blocks for the rest and caches the new full ones.
        Returns (block ids, cached blocks) or None when the cache cannot hold it now.
        """
        hit = self.cached_prefix_blocks(chain)
        needed = -(-num_tokens // self.block_size) - hit
        reusable_from_lru = sum(1 for h in chain[:hit] if self._by_hash[h] in self._lru)
        if needed > self.free_blocks - reusable_from_lru:
            return None
        blocks = [self._ref_cached(self._by_hash[h]) for h in chain[:hit]]
        evicted: list[SequenceHash] = []
        for _ in range(needed):
            blocks.append(self._take_block(evicted))
        if evicted:
            self._emit(KvRemoved(tuple(evicted)))
        self._cache_full_blocks(blocks, chain, locals_, hit)
        return blocks, hit

    def append_block(self) -> int | None:
        """One more block for a growing sequence, or None when every block is referenced."""
        if self.free_blocks == 0:
            return None
        evicted: list[SequenceHash] = []
        block = self._take_block(evicted)
        if evicted:
            self._emit(KvRemoved(tuple(evicted)))
        return block

    def cache_block(self, block: int, parent_hash: SequenceHash | None, chain_hash: SequenceHash,
                    local_hash: LocalBlockHash) -> None:
        """Marks a block that just became full (during decode) as cached."""
        if chain_hash in self._by_hash or self._hash_of[block] != NO_HASH:
            return
        self._by_hash[chain_hash] = block
        self._hash_of[block] = chain_hash
        self._emit(KvStored(parent_hash, ((chain_hash, local_hash),)))

    def free(self, blocks: list[int]) -> None:
        """Drops one reference to each block; cached ones stay reusable until evicted."""
        for block in reversed(blocks):
            refs = self._refs[block] - 1
            self._refs[block] = refs
            if refs:
                continue
            if self._hash_of[block] == NO_HASH:
                self._never_used.append(block)
            else:
                self._lru[block] = None

    # -- internals -----------------------------------------------------------------------------

    def _ref_cached(self, block: int) -> int:
        self._lru.pop(block, None)
        self._refs[block] += 1
        return block

    def _take_block(self, evicted: list[SequenceHash]) -> int:
        if self._never_used:
            block = self._never_used.pop()
        else:
            block, _ = self._lru.popitem(last=False)
            old = self._hash_of[block]
            del self._by_hash[old]
            self._hash_of[block] = NO_HASH
            evicted.append(old)
        self._refs[block] = 1
        return block

    def _cache_full_blocks(self, blocks: list[int], chain: list[SequenceHash], locals_: list[LocalBlockHash],
                           start: int) -> None:
        stored: list[tuple[SequenceHash, LocalBlockHash]] = []
        for i in range(start, len(chain)):
            h = chain[i]
            if h in self._by_hash:
                break
            self._by_hash[h] = blocks[i]
            self._hash_of[blocks[i]] = h
            stored.append((h, locals_[i]))
        if stored:
            parent = chain[start - 1] if start > 0 else None
            self._emit(KvStored(parent, tuple(stored)))
