"""A deliberately naive model of Dynamo's RadixTree semantics, to check the fast index against.

Plain objects, sets of worker ids, a walk that touches every worker at every level.
"""

from __future__ import annotations


class RefNode:
    def __init__(self) -> None:
        self.children: dict[int, RefNode] = {}
        self.workers: set[object] = set()


class ReferenceTree:
    def __init__(self) -> None:
        self.root = RefNode()
        self.lookup: dict[object, dict[int, RefNode]] = {}

    def store(self, worker: object, parent_hash: int | None, blocks: list[tuple[int, int]]) -> int:
        lookup = self.lookup.setdefault(worker, {})
        if parent_hash is None:
            current = self.root
        elif parent_hash in lookup:
            current = lookup[parent_hash]
        else:
            return 0
        applied = 0
        for block_hash, tokens_hash in blocks:
            if tokens_hash in current.children:
                child = current.children[tokens_hash]
            else:
                child = lookup.get(block_hash) or RefNode()
                current.children[tokens_hash] = child
            if child is current:
                return applied
            child.workers.add(worker)
            lookup[block_hash] = child
            current = child
            applied += 1
        return applied

    def remove(self, worker: object, block_hashes: list[int]) -> int:
        lookup = self.lookup.setdefault(worker, {})
        removed = 0
        for block_hash in block_hashes:
            node = lookup.get(block_hash)
            if node is None:
                continue
            node.workers.discard(worker)
            if not node.workers:
                node.children = {}
            del lookup[block_hash]
            removed += 1
        return removed

    def clear(self, worker: object) -> None:
        for node in self.lookup.get(worker, {}).values():
            node.workers.discard(worker)
            if not node.workers:
                node.children = {}
        if worker in self.lookup:
            self.lookup[worker] = {}

    def remove_worker(self, worker: object) -> None:
        self.clear(worker)
        self.lookup.pop(worker, None)

    def block_count(self) -> int:
        return sum(len(blocks) for blocks in self.lookup.values())

    def find_matches(self, local_hashes: list[int]) -> dict[object, int]:
        scores: dict[object, int] = {}
        current = self.root
        for h in local_hashes:
            if h not in current.children:
                break
            current = current.children[h]
            for worker in current.workers:
                scores[worker] = scores.get(worker, 0) + 1
        return scores
