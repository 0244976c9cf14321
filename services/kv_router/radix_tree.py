"""The router's `KvIndex`: a radix tree of every worker's cached blocks, keyed by each block's
local hash, built for the router's hot paths in plain Python.

A path from the root is a prompt prefix; each node records which workers hold that block. The
semantics follow NVIDIA Dynamo's `RadixTree` exactly (so `find_matches` gives the same numbers
for the same events), including its edge cases, which `KvIndex` states in full: a stored event
whose parent the worker does not hold is skipped; a node left with no worker drops its
children; a block hash the worker already has is re-attached rather than duplicated.

How it stays fast:
- nodes are ints indexing parallel lists, not objects: no per-node object header, and nothing
  for the cyclic garbage collector to scan (with a million node objects its collections cost
  three times the work itself). Nodes are reference-counted by hand — parent links plus lookup
  entries — and their ids recycled; a leaf no worker holds any more is unlinked from its parent
  at once (Dynamo keeps such empty leaves until the parent empties: invisible to scores, but
  memory that grows with every evicted conversation). Only a node's latest link is known, so a
  node an engine re-linked elsewhere under a reused block hash stays until its parents go;
- workers are bits of an int mask per node (a slot per worker, reused once no node holds it); a
  worker's host tier is a holder with a slot of its own (`HostCopy`);
- a node keeps its first child inline; only a node with several children gets a dict (of ints,
  which the collector does not track either);
- scoring walks the path once and adds a *run* of equal masks at once, so a match costs
  O(depth + mask changes x workers) instead of touching every worker at every level.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from services.kv_router.kv_index import EventError, HostCopy, KvIndex, StoredBlock, holder
from services.mesh.hashing import LocalBlockHash, SequenceHash
from services.mesh.kv_tier import Tier

ROOT = 0
NO_KEY = -1  # local hashes are u64, never negative
UNKNOWN = -1


class RadixTree(KvIndex):
    def __init__(self) -> None:
        # Per node: local hash of its inline child, the inline child, its other children, the
        # mask of workers holding it, and its reference count.
        self._key: list[int] = [NO_KEY]
        self._child: list[int] = [ROOT]
        self._more: list[dict[int, int] | None] = [None]
        self._mask: list[int] = [0]
        self._refs: list[int] = [1]
        # The parent holding the node's most recent link and the local hash it is linked under
        # (UNKNOWN once that parent let go of it), for unlinking empty leaves.
        self._parent: list[int] = [UNKNOWN]
        self._edge: list[int] = [NO_KEY]
        self._free_nodes: list[int] = []
        self._slot_of: dict[Hashable, int] = {}
        self._worker_of_slot: dict[int, Hashable] = {}
        self._lookup: dict[int, dict[SequenceHash, int]] = {}  # slot -> block hash -> node
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
            slot = self._free_slots.pop() if self._free_slots else len(self._worker_of_slot) + len(self._retired)
            self._slot_of[worker] = slot
            self._worker_of_slot[slot] = worker
            self._lookup[slot] = {}
            self._nodes_with_bit[slot] = 0
        return slot

    def block_count(self, worker: Hashable | None = None) -> int:
        if worker is None:
            return sum(len(m) for m in self._lookup.values())
        slot = self._slot_of.get(worker)
        return 0 if slot is None else len(self._lookup[slot])

    def node_count(self) -> int:
        """Live nodes, the root included."""
        return len(self._key) - len(self._free_nodes)

    # -- node memory ---------------------------------------------------------------------------

    def _release(self, node: int) -> None:
        """Drops one reference; a node nobody references is freed, with its links to children."""
        refs = self._refs
        refs[node] -= 1
        if refs[node] == 1:
            self._prune_if_empty_leaf(node)
            return
        if refs[node]:
            return
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(c for c in self._unlink_children(n) if self._dec(c))
            mask = self._mask[n]
            while mask:  # stale marks of workers whose lookup moved on
                low = mask & -mask
                self._uncount(low.bit_length() - 1)
                mask ^= low
            self._mask[n] = 0
            self._parent[n] = UNKNOWN
            self._free_nodes.append(n)

    def _prune_if_empty_leaf(self, node: int) -> None:
        """Unlinks a node whose only reference is its parent's link, if it is an empty leaf."""
        parent = self._parent[node]
        if parent == UNKNOWN or self._mask[node] or self._key[node] != NO_KEY or self._more[node]:
            return
        edge = self._edge[node]
        if self._key[parent] == edge and self._child[parent] == node:
            more = self._more[parent]
            if more:  # promote another child to the inline place
                key, child = more.popitem()
                self._key[parent], self._child[parent] = key, child
                if not more:
                    self._more[parent] = None
            else:
                self._key[parent], self._child[parent] = NO_KEY, ROOT
        elif (more := self._more[parent]) is not None and more.get(edge) == node:
            del more[edge]
            if not more:
                self._more[parent] = None
        else:
            return
        self._parent[node] = UNKNOWN
        self._release(node)

    def _dec(self, node: int) -> bool:
        self._refs[node] -= 1
        return self._refs[node] == 0

    def _unlink_children(self, node: int) -> list[int]:
        children = []
        if self._key[node] != NO_KEY:
            children.append(self._child[node])
        more = self._more[node]
        if more:
            children.extend(more.values())
        self._key[node] = NO_KEY
        self._child[node] = ROOT
        self._more[node] = None
        for child in children:
            if self._parent[child] == node:
                self._parent[child] = UNKNOWN
        return children

    def _drop_children(self, node: int) -> None:
        for child in self._unlink_children(node):
            self._release(child)

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
        bit = 1 << slot
        lookup = self._lookup[slot]
        if parent_hash is None:
            current = ROOT
        else:
            found = lookup.get(parent_hash)
            if found is None and tier == Tier.HOST:
                device = self._slot_of.get(name)
                found = None if device is None else self._lookup[device].get(parent_hash)
            if found is None:
                raise EventError(f"worker {name}: parent block {parent_hash} unknown; store skipped")
            current = found
        keys, kids, more_of, masks, refs = self._key, self._child, self._more, self._mask, self._refs
        parents, edges, free_nodes = self._parent, self._edge, self._free_nodes
        added = applied = 0
        for block_hash, tokens_hash in blocks:
            previous = lookup.get(block_hash)
            if keys[current] == tokens_hash:
                child = kids[current]
            else:
                more = more_of[current]
                found = None if more is None else more.get(tokens_hash)
                if found is None:
                    if previous is not None:
                        child = previous
                    elif free_nodes:
                        child = free_nodes.pop()
                    else:  # a new node, inline: this is the hottest allocation
                        child = len(keys)
                        keys.append(NO_KEY)
                        kids.append(ROOT)
                        more_of.append(None)
                        masks.append(0)
                        refs.append(0)
                        parents.append(UNKNOWN)
                        edges.append(NO_KEY)
                    refs[child] += 1  # the parent's link
                    parents[child] = current
                    edges[child] = tokens_hash
                    if keys[current] == NO_KEY:
                        keys[current] = tokens_hash
                        kids[current] = child
                    elif more is None:
                        more_of[current] = {tokens_hash: child}
                    else:
                        more[tokens_hash] = child
                else:
                    child = found
            if child == current:
                self._nodes_with_bit[slot] += added
                raise EventError(f"worker {worker}: block {block_hash} refers to itself; rest of the store skipped")
            mask = masks[child]
            if not mask & bit:
                masks[child] = mask | bit
                added += 1
            if previous != child:
                lookup[block_hash] = child
                refs[child] += 1
                if previous is not None:
                    self._release(previous)
            current = child
            applied += 1
        self._nodes_with_bit[slot] += added
        return applied

    def remove(self, worker: Hashable, block_hashes: Iterable[SequenceHash], tier: Tier = Tier.DEVICE) -> int:
        """Applies a removed event; unknown blocks are skipped. Returns the number removed."""
        slot = self._slot_of.get(holder(worker, tier))
        if slot is None:
            return 0
        bit = 1 << slot
        lookup = self._lookup[slot]
        masks = self._mask
        removed = cleared = 0
        for block_hash in block_hashes:
            node = lookup.pop(block_hash, None)
            if node is None:
                continue
            removed += 1
            mask = masks[node]
            if mask & bit:
                mask ^= bit
                masks[node] = mask
                cleared += 1
            if not mask:
                # No worker holds this block, so none holds anything below it (Dynamo's rule).
                self._drop_children(node)
            self._nodes_with_bit[slot] -= cleared
            cleared = 0
            self._release(node)
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
        masks = self._mask
        lookup = self._lookup[slot]
        self._lookup[slot] = {}
        for node in lookup.values():
            mask = masks[node]
            if mask & bit:
                mask ^= bit
                masks[node] = mask
                self._nodes_with_bit[slot] -= 1
            if not mask:
                self._drop_children(node)
        for node in lookup.values():
            self._release(node)

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
        keys, kids, more_of, masks = self._key, self._child, self._more, self._mask
        node = ROOT
        run_mask = 0
        run = 0
        runs: list[tuple[int, int]] = []
        for h in local_hashes:
            if keys[node] == h:
                node = kids[node]
            else:
                more = more_of[node]
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
