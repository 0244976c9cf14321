"""A deliberately naive `KvIndex`: the semantics written as plainly as possible, to check the fast
radix tree against (tests) and to measure it against (the replay benchmark's baseline).

Plain node objects, a set of workers per node, a walk that touches every worker at every level:
slow and memory-hungry on purpose, so that it is obviously right. `KvIndex` states the rules.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from services.routing.kv_index import EventError, EventErrorKind, HostCopy, KvIndex, StoredBlock, holder
from services.kv_protocol.hashing import LocalBlockHash, SequenceHash
from services.kv_protocol.tier import Tier


class RefNode:
    def __init__(self) -> None:
        self.children: dict[LocalBlockHash, RefNode] = {}
        self.workers: set[Hashable] = set()


class ReferenceIndex(KvIndex):
    def __init__(self) -> None:
        self.root = RefNode()
        # Per worker, the node of every block it holds, by the block's sequence hash.
        self.lookup: dict[Hashable, dict[SequenceHash, RefNode]] = {}

    def store(self, worker: Hashable, parent_hash: SequenceHash | None, blocks: Iterable[StoredBlock],
              tier: Tier = Tier.DEVICE) -> int:
        name = worker
        worker = holder(name, tier)
        lookup = self.lookup.setdefault(worker, {})
        # A host block's parent may still be on the device; a device block's parent is on the device.
        other = self.lookup.get(name, {}) if tier == Tier.HOST else {}
        if parent_hash is None:
            current = self.root
        elif parent_hash in lookup:
            current = lookup[parent_hash]
        elif parent_hash in other:
            current = other[parent_hash]
        else:
            raise EventError(EventErrorKind.UNKNOWN_PARENT,
                             f"worker {name}: parent block {parent_hash} unknown; store skipped")
        applied = 0
        for block_hash, tokens_hash in blocks:
            child = current.children.get(tokens_hash) or lookup.get(block_hash) or RefNode()
            if child is current:
                # Checked before linking: a self-link would let a walk repeat this block forever.
                raise EventError(EventErrorKind.CONTRADICTS_TREE,
                                 f"worker {name}: block {block_hash} refers to itself; rest of the store skipped")
            current.children[tokens_hash] = child
            child.workers.add(worker)
            lookup[block_hash] = child
            current = child
            applied += 1
        return applied

    def remove(self, worker: Hashable, block_hashes: Iterable[SequenceHash], tier: Tier = Tier.DEVICE) -> int:
        worker = holder(worker, tier)
        lookup = self.lookup.get(worker, {})
        removed = 0
        for block_hash in block_hashes:
            node = lookup.pop(block_hash, None)
            if node is None:
                continue
            self._let_go(worker, node)
            removed += 1
        return removed

    def clear(self, worker: Hashable) -> None:
        for key in (worker, HostCopy(worker)):
            for node in self.lookup.get(key, {}).values():
                self._let_go(key, node)
            if key in self.lookup:
                self.lookup[key] = {}

    def remove_worker(self, worker: Hashable) -> None:
        self.clear(worker)
        self.lookup.pop(worker, None)
        self.lookup.pop(HostCopy(worker), None)

    def block_count(self, worker: Hashable | None = None) -> int:
        if worker is None:
            return sum(len(blocks) for blocks in self.lookup.values())
        return len(self.lookup.get(worker, {}))

    def find_matches(self, local_hashes: Sequence[LocalBlockHash]) -> dict[Hashable, int]:
        return self.find_matches_by_tier(local_hashes)[0]

    def find_matches_by_tier(self, local_hashes: Sequence[LocalBlockHash]
                             ) -> tuple[dict[Hashable, int], dict[Hashable, int]]:
        device: dict[Hashable, int] = {}
        host: dict[Hashable, int] = {}
        current = self.root
        for h in local_hashes:
            if h not in current.children:
                break
            current = current.children[h]
            for worker in current.workers:
                if not isinstance(worker, HostCopy):
                    device[worker] = device.get(worker, 0) + 1
                elif worker.worker not in current.workers:
                    host[worker.worker] = host.get(worker.worker, 0) + 1
        return device, host

    @staticmethod
    def _let_go(worker: Hashable, node: RefNode) -> None:
        node.workers.discard(worker)
        if not node.workers:
            # No worker holds this block, so none can hold anything below it.
            node.children = {}
