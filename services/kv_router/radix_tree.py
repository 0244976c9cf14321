"""The KV index: a radix tree of every worker's cached blocks, keyed by each block's local hash.

A path from the root is a prompt prefix; each node records which workers hold that block. The
semantics follow NVIDIA Dynamo's `RadixTree` exactly (so `find_matches` gives the same numbers
for the same events), including its edge cases: a stored event whose parent the worker does not
hold is skipped; a node left with no worker drops its children; a block hash the worker already
has is re-attached rather than duplicated.

Built for the hot paths, in plain Python:
- workers are bits of an int mask per node (a slot per worker, reused once no node holds it);
- a node keeps its first child inline and only a node with several children gets a dict: most
  nodes of a conversation tree have one child, and a dict costs ~180 bytes;
- scoring walks the path once and adds a *run* of equal masks at once, so a match costs
  O(depth + mask changes x workers) instead of touching every worker at every level.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence


class Node:
    __slots__ = ("key", "child", "more", "mask")

    def __init__(self) -> None:
        self.key: int | None = None  # local hash of the inline (first) child
        self.child: Node | None = None
        self.more: dict[int, Node] | None = None  # the other children
        self.mask = 0

    def get(self, local_hash: int) -> Node | None:
        if self.key == local_hash:
            return self.child
        more = self.more
        return None if more is None else more.get(local_hash)

    def put(self, local_hash: int, node: Node) -> None:
        if self.child is None or self.key == local_hash:
            self.key, self.child = local_hash, node
        elif self.more is None:
            self.more = {local_hash: node}
        else:
            self.more[local_hash] = node

    def drop_children(self) -> None:
        self.key = self.child = self.more = None


class EventError(Exception):
    """An event the index could not (fully) apply; the index stays consistent."""


class RadixTree:
    def __init__(self) -> None:
        self._root = Node()
        self._slot_of: dict[Hashable, int] = {}
        self._worker_of_slot: dict[int, Hashable] = {}
        self._lookup: dict[int, dict[int, Node]] = {}  # slot -> block hash -> node
        self._nodes_with_bit: dict[int, int] = {}  # slot -> how many nodes carry its bit
        self._free_slots: list[int] = []
        # Slots of removed workers whose bit is still set on stale nodes, with the worker's name.
        self._retired: dict[int, Hashable] = {}

    # -- workers -------------------------------------------------------------------------------

    def _slot(self, worker: Hashable) -> int:
        slot = self._slot_of.get(worker)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._worker_of_slot) + len(self._retired)
            while slot in self._worker_of_slot or slot in self._retired:
                slot += 1
            self._slot_of[worker] = slot
            self._worker_of_slot[slot] = worker
            self._lookup[slot] = {}
            self._nodes_with_bit[slot] = 0
        return slot

    @property
    def workers(self) -> list[Hashable]:
        return list(self._slot_of)

    def block_count(self, worker: Hashable | None = None) -> int:
        if worker is None:
            return sum(len(m) for m in self._lookup.values())
        slot = self._slot_of.get(worker)
        return 0 if slot is None else len(self._lookup[slot])

    # -- events --------------------------------------------------------------------------------

    def store(self, worker: Hashable, parent_hash: int | None, blocks: Iterable[tuple[int, int]]) -> int:
        """Applies a stored event; returns the number of blocks applied."""
        slot = self._slot(worker)
        bit = 1 << slot
        lookup = self._lookup[slot]
        if parent_hash is None:
            current = self._root
        else:
            current = lookup.get(parent_hash)
            if current is None:
                raise EventError(f"worker {worker}: parent block {parent_hash} unknown; store skipped")
        added = 0
        applied = 0
        new_node = Node
        for block_hash, tokens_hash in blocks:
            if current.key == tokens_hash:
                child = current.child
            else:
                more = current.more
                child = None if more is None else more.get(tokens_hash)
                if child is None:
                    child = lookup.get(block_hash) or new_node()
                    if current.child is None:
                        current.key, current.child = tokens_hash, child
                    else:
                        current.put(tokens_hash, child)
            if child is current:
                self._nodes_with_bit[slot] += added
                raise EventError(f"worker {worker}: block {block_hash} refers to itself; rest of the store skipped")
            mask = child.mask  # type: ignore[union-attr]
            if not mask & bit:
                # A lone worker's mask is the shared `bit` object: no new int per node.
                child.mask = mask | bit if mask else bit  # type: ignore[union-attr]
                added += 1
            lookup[block_hash] = child  # type: ignore[assignment]
            current = child  # type: ignore[assignment]
            applied += 1
        self._nodes_with_bit[slot] += added
        return applied

    def remove(self, worker: Hashable, block_hashes: Iterable[int]) -> int:
        """Applies a removed event; unknown blocks are skipped. Returns the number removed."""
        slot = self._slot_of.get(worker)
        if slot is None:
            return 0
        bit = 1 << slot
        lookup = self._lookup[slot]
        removed = cleared = 0
        for block_hash in block_hashes:
            node = lookup.pop(block_hash, None)
            if node is None:
                continue
            removed += 1
            mask = node.mask
            if mask & bit:
                mask ^= bit
                node.mask = mask
                cleared += 1
            if not mask:
                # No worker holds this block, so none holds anything below it (Dynamo's rule).
                node.drop_children()
        self._nodes_with_bit[slot] -= cleared
        return removed

    def clear(self, worker: Hashable) -> None:
        """Applies a cleared event: the worker holds nothing, but stays known."""
        slot = self._slot_of.get(worker)
        if slot is not None:
            self._drop_blocks(slot)

    def remove_worker(self, worker: Hashable) -> None:
        """Forgets a worker (its lease is gone): all its blocks, then its slot."""
        slot = self._slot_of.pop(worker, None)
        if slot is None:
            return
        self._drop_blocks(slot)
        del self._worker_of_slot[slot]
        del self._lookup[slot]
        if self._nodes_with_bit.pop(slot) == 0:
            self._free_slots.append(slot)
        else:
            # Nodes it left without a lookup entry (re-stored hashes) still carry the bit, as in
            # Dynamo; the slot is never reused, so those stale marks never count for another worker.
            self._retired[slot] = worker

    def _drop_blocks(self, slot: int) -> None:
        bit = 1 << slot
        cleared = 0
        for node in self._lookup[slot].values():
            mask = node.mask
            if mask & bit:
                mask ^= bit
                node.mask = mask
                cleared += 1
            if not mask:
                node.drop_children()
        self._lookup[slot] = {}
        self._nodes_with_bit[slot] -= cleared

    # -- queries -------------------------------------------------------------------------------

    def find_matches(self, local_hashes: Sequence[int]) -> dict[Hashable, int]:
        """Per worker, the number of matched levels (walking from the root) that contain it."""
        node = self._root
        run_mask = 0
        run = 0
        counts: dict[int, int] = {}
        for h in local_hashes:
            if node.key == h:
                node = node.child  # type: ignore[assignment]
            else:
                more = node.more
                if more is None or (node := more.get(h)) is None:  # type: ignore[assignment]
                    break
            mask = node.mask
            if mask == run_mask:
                run += 1
                continue
            if run_mask:
                _add_run(counts, run_mask, run)
            run_mask = mask
            run = 1
        if run_mask:
            _add_run(counts, run_mask, run)
        names = self._worker_of_slot
        return {(names[slot] if slot in names else self._retired[slot]): n for slot, n in counts.items()}

    def matched_depth(self, local_hashes: Sequence[int]) -> int:
        """How many leading blocks exist in the tree at all (for any worker)."""
        node = self._root
        depth = 0
        for h in local_hashes:
            if (node := node.get(h)) is None:  # type: ignore[assignment]
                break
            depth += 1
        return depth


def _add_run(counts: dict[int, int], mask: int, run: int) -> None:
    while mask:
        low = mask & -mask
        slot = low.bit_length() - 1
        counts[slot] = counts.get(slot, 0) + run
        mask ^= low
