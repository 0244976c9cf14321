"""The router's `KvIndex`: a radix tree of every worker's cached blocks, keyed by each block's
local hash, in plain Python: the fallback where the native index (services/routing/native/) is
not built, and a second implementation the native one is tested against.

A path from the root is a prompt prefix; each node records which workers hold that block. The
semantics are `KvIndex`'s, including its edge cases, which `KvIndex` states in full: a stored event
whose parent the worker does not hold is skipped; a node left with no worker drops its
children; a block hash the worker already has is re-attached rather than duplicated.

How it stays fast and small (about 90 bytes of resident memory per held block on the indexer
benchmark's trace, where the same tree of Python objects took 140):
- nodes are ids into parallel typed arrays (`TreeNodes`), reference-counted by hand and recycled;
  a leaf no worker holds any more is unlinked at once (Dynamo keeps such empty leaves until the
  parent empties: invisible to scores, but memory that grows with every evicted conversation);
- each holder's blocks are an open-addressing table of (sequence hash, node) pairs in one typed
  array (`BlockTable`), which the event loops probe inline;
- holders are bits of a 64-bit mask per node (a slot per holder, reused once no node holds it);
  a worker's host tier is a holder with a slot of its own (`HostCopy`). Past 64 holders the
  masks become Python ints: any width, at a pointer and an int more per node;
- a node keeps its first child inline; only a node with several children has a dict of the
  others;
- a stored chain that grows past what the tree held takes a short path per block: a new node
  has no children and no other holder, so there is nothing to look up;
- scoring walks the path once and adds a *run* of equal masks at once, so a match costs
  O(depth + mask changes x workers) instead of touching every worker at every level.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from services.routing.block_table import FREE, GONE, BlockTable
from services.routing.kv_index import EventError, EventErrorKind, HostCopy, KvIndex, StoredBlock, holder
from services.routing.tree_nodes import ROOT, TreeNodes
from services.kv_protocol.hashing import LocalBlockHash, SequenceHash
from services.kv_protocol.tier import Tier

U64_MAX = (1 << 64) - 1
MASK_BITS = 64  # holders a node's mask holds in its typed array


class RadixTree(KvIndex):
    def __init__(self) -> None:
        self._nodes = TreeNodes(on_stale_bit=self._uncount)
        self._slot_of: dict[Hashable, int] = {}
        self._worker_of_slot: dict[int, Hashable] = {}
        self._lookup: dict[int, BlockTable] = {}  # slot -> its blocks' nodes by sequence hash
        self._nodes_with_bit: dict[int, int] = {}  # slot -> how many nodes carry its bit
        self._free_slots: list[int] = []
        # Slots of removed workers whose bit is still set on stale nodes, with the worker's name.
        self._retired: dict[int, Hashable] = {}
        # Whether any host tier was ever stored: until then every holder is a device.
        self._tiered = False

    # -- workers -------------------------------------------------------------------------------

    def _slot(self, worker: Hashable) -> int:
        slot = self._slot_of.get(worker)
        if slot is None:
            # A removed worker whose stale marks are still on nodes gets that slot back, so those
            # marks stay its own (the reference keys holders by name; the native tree does the same).
            slot = next((s for s, name in self._retired.items() if name == worker), None)
            if slot is not None:
                del self._retired[slot]
            else:
                slot = self._free_slots.pop() if self._free_slots else len(self._worker_of_slot) + len(self._retired)
                self._nodes_with_bit[slot] = 0
            self._slot_of[worker] = slot
            self._worker_of_slot[slot] = worker
            self._lookup[slot] = BlockTable()
            if slot >= MASK_BITS:
                self._nodes.widen_masks()
        return slot

    def block_count(self, worker: Hashable | None = None) -> int:
        if worker is None:
            return sum(len(m) for m in self._lookup.values())
        slot = self._slot_of.get(worker)
        return 0 if slot is None else len(self._lookup[slot])

    def node_count(self) -> int:
        """Live nodes, the root included."""
        return self._nodes.count()

    def _uncount(self, slot: int) -> None:
        self._nodes_with_bit[slot] = left = self._nodes_with_bit[slot] - 1
        if left == 0 and slot in self._retired:
            del self._retired[slot]
            del self._nodes_with_bit[slot]
            self._free_slots.append(slot)

    # -- events --------------------------------------------------------------------------------

    def store(self, worker: Hashable, parent_hash: SequenceHash | None, blocks: Iterable[StoredBlock],
              tier: Tier = Tier.DEVICE) -> int:
        """Applies a stored event; returns the number of blocks applied."""
        name = worker
        worker = holder(name, tier)
        self._tiered |= tier == Tier.HOST
        slot = self._slot(worker)
        lookup = self._lookup[slot]
        if parent_hash is None:
            current = ROOT
        else:
            current = lookup.get(parent_hash)
            if not current and tier == Tier.HOST and (device := self._slot_of.get(name)) is not None:
                current = self._lookup[device].get(parent_hash)
            if not current:
                raise EventError(EventErrorKind.UNKNOWN_PARENT,
                                 f"worker {name}: parent block {parent_hash} unknown; store skipped")
        if type(blocks) is not list:
            blocks = list(blocks)
        if (lookup.count + lookup.gone + len(blocks)) * 2 > lookup.mask + 1:
            lookup.reserve(len(blocks))
        if len(self._nodes.free) < len(blocks):
            self._nodes.grow(len(blocks))
        bit = 1 << slot
        pairs, home, wrap = lookup.pairs, lookup.mask, 2 * lookup.mask + 1
        nodes = self._nodes
        keys, kids, more_of, more_edge, masks = nodes.key, nodes.child, nodes.more, nodes.more_edge, nodes.mask
        refs, parents, free_nodes = nodes.refs, nodes.parent, nodes.free
        applied = added = entries = revived = made = 0  # `made`: blocks the fast path added
        fresh = False  # whether `current` was made by this loop: no children, no other holder
        # The first write of each hash changes nothing else, so a hash that does not fit 64 bits
        # stops the loop before its block touched the tree.
        try:
            for block_hash, tokens_hash in blocks:
                i = (block_hash & home) << 1  # the lookup table, probed inline (`BlockTable`'s rules)
                while (previous := pairs[i + 1]) and pairs[i] != block_hash:
                    i = (i + 2) & wrap
                if not previous or previous == GONE:
                    if previous:
                        revived += 1
                        previous = FREE
                    pairs[i] = block_hash
                    if fresh:  # the chain grows past what the tree held: a new node, nothing to look up
                        keys[current] = tokens_hash
                        child = free_nodes.pop()
                        refs[child] = 2  # the parent's link and the lookup entry
                        parents[child] = current
                        kids[current] = child
                        masks[child] = bit
                        pairs[i + 1] = child
                        made += 1
                        current = child
                        continue
                fresh = False
                if keys[current] == tokens_hash and (child := kids[current]):
                    pass
                elif (more := more_of.get(current)) is not None and (found := more.get(tokens_hash)) is not None:
                    child = found
                else:
                    if previous:  # a block hash the worker has: its node, re-linked here
                        if previous == current:  # checked before linking: a self-link would loop a walk
                            raise EventError(EventErrorKind.CONTRADICTS_TREE, f"worker {name}: block {block_hash} "
                                             "refers to itself; rest of the store skipped")
                        child = previous
                    else:
                        child = free_nodes[-1]
                        fresh = True
                    if not kids[current]:
                        keys[current] = tokens_hash
                        kids[current] = child
                    else:
                        if not 0 <= tokens_hash <= U64_MAX:  # dicts take any int: check, as arrays do
                            raise OverflowError(tokens_hash)
                        more_edge[child] = tokens_hash
                        if more is None:
                            more_of[current] = {tokens_hash: child}
                        else:
                            more[tokens_hash] = child
                    if fresh:
                        free_nodes.pop()
                    refs[child] += 1  # the parent's link
                    parents[child] = current
                mask = masks[child]
                if not mask & bit:
                    masks[child] = mask | bit
                    added += 1
                if previous != child:
                    pairs[i + 1] = child
                    refs[child] += 1
                    if previous:
                        self._nodes.release(previous)
                    else:
                        entries += 1
                current = child
                applied += 1
        except OverflowError:
            raise EventError(EventErrorKind.BAD_HASH,
                             f"worker {name}: a block hash is not a 64-bit unsigned int; rest of the store skipped") from None
        finally:
            self._nodes_with_bit[slot] += added + made
            lookup.count += entries + made
            lookup.gone -= revived
        return applied + made

    def remove(self, worker: Hashable, block_hashes: Iterable[SequenceHash], tier: Tier = Tier.DEVICE) -> int:
        """Applies a removed event; unknown blocks are skipped. Returns the number removed."""
        slot = self._slot_of.get(holder(worker, tier))
        if slot is None:
            return 0
        bit = 1 << slot
        lookup = self._lookup[slot]
        pairs, home, wrap = lookup.pairs, lookup.mask, 2 * lookup.mask + 1
        masks = self._nodes.mask
        removed = cleared = 0
        try:
            for block_hash in block_hashes:
                i = (block_hash & home) << 1  # `BlockTable`'s probe, inline
                while (node := pairs[i + 1]) and pairs[i] != block_hash:
                    i = (i + 2) & wrap
                if not node or node == GONE:
                    continue
                pairs[i + 1] = GONE
                removed += 1
                mask = masks[node]
                if mask & bit:
                    mask ^= bit
                    masks[node] = mask
                    cleared += 1
                if not mask:
                    # No worker holds this block, so none holds anything below it (Dynamo's rule).
                    self._nodes.drop_children(node)
                self._nodes.release(node)
        finally:
            lookup.count -= removed
            lookup.gone += removed
            self._nodes_with_bit[slot] -= cleared
        return removed

    def clear(self, worker: Hashable) -> None:
        """Applies a cleared event: the worker holds nothing in either tier, but stays known."""
        for key in (worker, HostCopy(worker)) if self._tiered else (worker,):
            slot = self._slot_of.get(key)
            if slot is not None:
                self._drop_blocks(slot)

    def remove_worker(self, worker: Hashable) -> None:
        """Forgets a worker (its lease is gone): all its blocks in both tiers, then its slots."""
        self._forget(worker)
        if self._tiered:
            self._forget(HostCopy(worker))

    def _forget(self, worker: Hashable) -> None:
        slot = self._slot_of.pop(worker, None)
        if slot is None:
            return
        self._drop_blocks(slot)
        del self._worker_of_slot[slot]
        del self._lookup[slot]
        if self._nodes_with_bit[slot] == 0:
            del self._nodes_with_bit[slot]
            self._free_slots.append(slot)
        else:
            # Nodes it left without a lookup entry (re-stored hashes) still carry the bit, as in
            # Dynamo; the slot is reused only once no node does, so those marks never count for
            # another worker.
            self._retired[slot] = worker

    def _drop_blocks(self, slot: int) -> None:
        bit = 1 << slot
        masks = self._nodes.mask
        held = self._lookup[slot].held_nodes()
        self._lookup[slot] = BlockTable()
        for node in held:
            mask = masks[node]
            if mask & bit:
                mask ^= bit
                masks[node] = mask
                self._nodes_with_bit[slot] -= 1
            if not mask:
                self._nodes.drop_children(node)
        for node in held:
            self._nodes.release(node)

    # -- queries -------------------------------------------------------------------------------

    def find_matches(self, local_hashes: Sequence[LocalBlockHash]) -> dict[Hashable, int]:
        """Per worker, the number of matched levels (walking from the root) its device holds."""
        counts: dict[int, int] = {}
        for mask, run in self._runs(local_hashes):
            _add_run(counts, mask, run)
        found = {self._name(slot): n for slot, n in counts.items()}
        if self._tiered:
            return {w: n for w, n in found.items() if not isinstance(w, HostCopy)}
        return found

    def find_matches_by_tier(self, local_hashes: Sequence[LocalBlockHash]
                             ) -> tuple[dict[Hashable, int], dict[Hashable, int]]:
        """`find_matches`, and per worker the matched levels held in its host tier only."""
        if not self._tiered:
            return self.find_matches(local_hashes), {}
        runs = self._runs(local_hashes)
        device: dict[Hashable, int] = {}
        host: dict[Hashable, int] = {}
        slot_of = self._slot_of
        for mask, run in runs:
            rest = mask
            while rest:
                low = rest & -rest
                rest ^= low
                slot = low.bit_length() - 1
                name = self._name(slot)
                if not isinstance(name, HostCopy):
                    device[name] = device.get(name, 0) + run
                    continue
                own = slot_of.get(name.worker)
                if own is None or not mask >> own & 1:  # on the device too: a device hit
                    host[name.worker] = host.get(name.worker, 0) + run
        return device, host

    def _name(self, slot: int) -> Hashable:
        """The holder a slot's bit stands for (a removed worker's, while stale nodes carry it)."""
        return self._worker_of_slot[slot] if slot in self._worker_of_slot else self._retired[slot]

    def _runs(self, local_hashes: Sequence[LocalBlockHash]) -> list[tuple[int, int]]:
        """The walk from the root along the prompt, as runs of levels with equal holder masks."""
        nodes = self._nodes
        keys, kids, more_of, masks = nodes.key, nodes.child, nodes.more, nodes.mask
        node = ROOT
        run_mask = 0
        run = 0
        runs: list[tuple[int, int]] = []
        for h in local_hashes:
            if keys[node] == h and (inline := kids[node]):
                node = inline
            else:
                more = more_of.get(node)
                if more is None:
                    break
                found = more.get(h)
                if found is None:
                    break
                node = found
            mask = masks[node]
            if mask == run_mask:
                run += 1
                continue
            if run_mask:
                runs.append((run_mask, run))
            run_mask = mask
            run = 1
        if run_mask:
            runs.append((run_mask, run))
        return runs


def _add_run(counts: dict[int, int], mask: int, run: int) -> None:
    while mask:
        low = mask & -mask
        slot = low.bit_length() - 1
        counts[slot] = counts.get(slot, 0) + run
        mask ^= low
