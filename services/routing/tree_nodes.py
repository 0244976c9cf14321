"""The radix tree's nodes: parallel typed arrays indexed by node id, with the reference counting
that frees a node once nothing links to it or names it, and the id recycling.

Per node: the local hash of its inline child, the inline child (`ROOT` when none), the mask of
holders, its reference count, and the parent holding its most recent link (`UNKNOWN` once that
parent let go of it, for unlinking empty leaves). A node's other children are in `more`, only for
the few nodes with several; `more_edge` keeps the local hash such a child was last linked under, to
find it there again. A node costs 28 bytes here, where as Python objects (a list slot and an int
per field) it cost over a hundred, and nothing here is for the cyclic collector to scan.

References: a parent's link and each holder's lookup entry count one each. A leaf no holder
holds is unlinked from its parent at once; a node nothing references is freed with its links to
its children. Only a node's latest link is known, so a node an engine re-linked elsewhere under a
reused block hash stays until its parents go.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, MutableSequence

import numpy as np

ROOT = 0  # also "no inline child": the root is nobody's child
UNKNOWN = 0xFFFF_FFFF  # no node id comes near it; unsigned arrays take ints fastest


class TreeNodes:
    def __init__(self, on_stale_bit: Callable[[int], None]) -> None:
        """`on_stale_bit(slot)`: a freed node still carried that holder's bit."""
        self.key = array("Q", [0])
        self.child = array("I", [ROOT])
        self.mask: MutableSequence[int] = array("Q", [0])  # 64 holders; a list of ints past that
        self.refs = array("I", [1])
        self.parent = array("I", [UNKNOWN])
        self.more: dict[int, dict[int, int]] = {}
        self.more_edge: dict[int, int] = {}
        self.free = array("I")  # freed and never-used ids, popped from the end
        self._on_stale_bit = on_stale_bit

    def count(self) -> int:
        """Live nodes, the root included."""
        return len(self.key) - len(self.free)

    def widen_masks(self) -> None:
        """Masks as Python ints from now on, for holders past the 64th: any width, at a pointer
        and an int more per node."""
        if isinstance(self.mask, array):
            self.mask = list(self.mask)

    def release(self, node: int) -> None:
        """Drops one reference; a node nobody references is freed, with its links to children."""
        refs = self.refs
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
            mask = self.mask[n]
            while mask:  # stale marks of workers whose lookup moved on
                low = mask & -mask
                self._on_stale_bit(low.bit_length() - 1)
                mask ^= low
            self.mask[n] = 0
            self.parent[n] = UNKNOWN
            self.more_edge.pop(n, None)
            self.free.append(n)

    def _prune_if_empty_leaf(self, node: int) -> None:
        """Unlinks a node whose only reference is its parent's link, if it is an empty leaf."""
        parent = self.parent[node]
        if parent == UNKNOWN or self.mask[node] or self.child[node] != ROOT or node in self.more:
            return
        if self.child[parent] == node:
            more = self.more.get(parent)
            if more:  # promote another child to the inline place
                key, child = more.popitem()
                self.key[parent], self.child[parent] = key, child
                if not more:
                    del self.more[parent]
            else:
                self.key[parent], self.child[parent] = 0, ROOT
        elif ((more := self.more.get(parent)) is not None and (edge := self.more_edge.get(node)) is not None
              and more.get(edge) == node):
            del more[edge]
            if not more:
                del self.more[parent]
        else:
            return
        self.parent[node] = UNKNOWN
        self.release(node)

    def _dec(self, node: int) -> bool:
        self.refs[node] -= 1
        return self.refs[node] == 0

    def _unlink_children(self, node: int) -> list[int]:
        children = []
        if self.child[node] != ROOT:
            children.append(self.child[node])
        more = self.more.pop(node, None)
        if more:
            children.extend(more.values())
        self.key[node] = 0
        self.child[node] = ROOT
        for child in children:
            if self.parent[child] == node:
                self.parent[child] = UNKNOWN
        return children

    def drop_children(self, node: int) -> None:
        for child in self._unlink_children(node):
            self.release(child)

    def grow(self, at_least: int) -> None:
        """Adds free nodes in one step (zeroed, unlinked), so the store loop only pops them."""
        first = len(self.key)
        extra = max(at_least, 1024, first // 8)
        for field in (self.key, self.child, self.refs):
            field.frombytes(bytes(field.itemsize * extra))
        if isinstance(self.mask, array):
            self.mask.frombytes(bytes(self.mask.itemsize * extra))
        else:
            self.mask.extend([0] * extra)
        self.parent.frombytes(np.full(extra, UNKNOWN, dtype=np.uint32).tobytes())
        # Popped from the end: the lowest ids first, so a new chain's nodes sit side by side.
        self.free.frombytes(np.arange(first + extra - 1, first - 1, -1, dtype=np.uint32).tobytes())
