"""One holder's blocks for the radix tree: a map from a block's sequence hash to its tree node,
stored in one typed array of (hash, node) pairs instead of a dict.

A dict entry for a 64-bit key costs about 100 bytes (the key's int object, the value's, the entry
and its index); a pair here costs 16, and the table keeps between a quarter and a half of its
pairs in use, so an entry costs 32 to 64 bytes. The index holds one entry per block per holder,
so this is most of what the router's memory grows with.

The rules, which the radix tree's loops follow inline (a method call per block would cost as much
as the probe itself):
- a hash's probe starts at pair `hash & mask` (its low bits: block hashes are xxh3 digests, as
  uniform there as anywhere; hashes sharing their low bits make probes long, never wrong) and
  walks forward to the first free pair or the pair holding the hash;
- node 0 (the tree's root, never a block) marks a free pair, `GONE` a deleted one: it keeps its
  hash and ends that hash's probe (a deleted hash stored again takes its old pair back), and
  other probes walk past it. Deleting is one write, where shifting later pairs back would be a
  loop; `reserve` lays the table out afresh (without the deleted pairs) once free pairs run low.
Hash and node share a pair so a probe touches one cache line, not one per array.
"""

from __future__ import annotations

from array import array

import numpy as np

FREE = 0
GONE = (1 << 64) - 1  # no node id comes near it
MIN_PAIRS = 8


class BlockTable:
    __slots__ = ("pairs", "mask", "count", "gone")

    def __init__(self) -> None:
        self.pairs = array("Q", bytes(16 * MIN_PAIRS))  # hash at 2i, node at 2i + 1
        self.mask = MIN_PAIRS - 1
        self.count = 0  # pairs holding a node
        self.gone = 0  # pairs deleted since the last layout

    def __len__(self) -> int:
        return self.count

    def find(self, block_hash: int) -> int:
        """The index of the pair holding `block_hash` (live or deleted), or of the free pair where it
        would go."""
        pairs, wrap = self.pairs, 2 * self.mask + 1
        i = (block_hash & self.mask) << 1
        while pairs[i + 1] and pairs[i] != block_hash:
            i = (i + 2) & wrap
        return i

    def get(self, block_hash: int) -> int:
        """The node of `block_hash`, or 0 (`FREE`) when this holder does not hold it."""
        node = self.pairs[self.find(block_hash) + 1]
        return FREE if node == GONE else node

    def reserve(self, extra: int) -> None:
        """Makes room for `extra` more entries with at most half the pairs taken (live or deleted);
        pair indexes found before a call are stale after it."""
        pairs = self.mask + 1
        if (self.count + self.gone + extra) * 2 <= pairs:
            return
        while (self.count + extra) * 4 > pairs:  # a quarter full after a growth, so growths are rare
            pairs *= 2
        self._lay_out(pairs)

    def held_nodes(self) -> list[int]:
        """Every entry's node (a node twice where two hashes name it)."""
        nodes = np.frombuffer(self.pairs, dtype=np.uint64)[1::2]
        held: list[int] = nodes[_live(nodes)].tolist()
        return held

    def _lay_out(self, size: int) -> None:
        """Places every live entry afresh in `size` pairs, vectorised in rounds: in round r each
        unplaced entry tries the pair r after its home, and takes it if it is free and no other
        entry tried it in that round. Pairs never come free again, so everything between an
        entry's home and its pair was taken when it passed: the probe rule holds."""
        table = np.frombuffer(self.pairs, dtype=np.uint64)
        nodes = table[1::2]
        live = _live(nodes)
        keys, held = table[0::2][live], nodes[live]
        mask = size - 1
        homes = (keys & np.uint64(mask)).astype(np.int32)
        pairs = array("Q", [0]) * (2 * size)
        laid = np.frombuffer(pairs, dtype=np.uint64)
        laid_keys, laid_nodes = laid[0::2], laid[1::2]
        claim = np.full(size, -1, dtype=np.int32)
        pending = np.arange(len(keys), dtype=np.int32)
        step = 0
        while len(pending):
            want = (homes[pending] + step) & mask
            tried = np.flatnonzero(laid_nodes[want] == FREE)
            tryers, spots = pending[tried], want[tried]
            claim[spots] = tryers  # of several entries after one pair, one write lands: it wins
            won = claim[spots] == tryers
            laid_keys[spots[won]] = keys[tryers[won]]
            laid_nodes[spots[won]] = held[tryers[won]]
            placed = np.zeros(len(pending), dtype=bool)
            placed[tried[won]] = True
            pending = pending[~placed]
            step += 1
        del laid, laid_keys, laid_nodes  # views on `pairs`, which must own its buffer alone
        self.pairs = pairs
        self.mask = mask
        self.gone = 0


def _live(nodes: np.ndarray) -> np.ndarray:
    """Which pairs hold an entry (neither free nor deleted), given the pairs' node column."""
    return (nodes != FREE) & (nodes != np.uint64(GONE))
