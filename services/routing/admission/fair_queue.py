"""The ordered queue requests wait in for a worker: priority bands served strictly in order,
weighted fair shares across tenants inside a band, earliest deadline first inside a tenant.

Fair shares are start-time fair queueing: each backlogged tenant of a band carries a virtual
start tag; the tenant with the smallest tag is served next, and its tag then advances by the
request's cost over the tenant's weight. A tenant that was idle starts at the band's virtual
time (the tag of the last request served), so idling earns no credit to spend later in a burst.
A tenant of weight 2 is therefore served twice as often as one of weight 1 while both wait,
and a light tenant's request waits behind at most about one request of each other tenant.

Removal (a request cancelled or expired while waiting) is lazy: the entry is marked and skipped
when it reaches its tenant's head, so removing is O(1) and the heaps never need a search.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(eq=False, slots=True)
class Entry(Generic[T]):
    """One waiting request: where it queues and what it weighs; `item` is the caller's."""

    item: T
    band: int
    tenant: str
    deadline: float
    cost: float = 1.0
    gone: bool = False


@dataclass(slots=True)
class _Tenant(Generic[T]):
    # (deadline, arrival order, entry): earliest deadline first, arrival order among equals.
    heap: list[tuple[float, int, Entry[T]]] = field(default_factory=list)
    live: int = 0
    tag: float = 0.0


@dataclass(slots=True)
class _Band(Generic[T]):
    tenants: dict[str, _Tenant[T]] = field(default_factory=dict)
    live: int = 0
    vtime: float = 0.0


class FairQueue(Generic[T]):
    """`weight_of(tenant)` is read at every choice, so a reloaded policy applies at once."""

    def __init__(self, weight_of: Callable[[str], float]) -> None:
        self._weight_of = weight_of
        self._bands: dict[int, _Band[T]] = {}
        self._arrivals = itertools.count()
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def depth(self, band: int) -> int:
        b = self._bands.get(band)
        return b.live if b is not None else 0

    def waiting(self, band: int, tenant: str) -> int:
        b = self._bands.get(band)
        t = b.tenants.get(tenant) if b is not None else None
        return t.live if t is not None else 0

    def bands(self) -> dict[int, int]:
        """Waiting requests per band (those with any)."""
        return {k: b.live for k, b in sorted(self._bands.items()) if b.live}

    def push(self, item: T, band: int, tenant: str, deadline: float, cost: float = 1.0) -> Entry[T]:
        b = self._bands.get(band)
        if b is None:
            b = self._bands[band] = _Band()
        t = b.tenants.get(tenant)
        if t is None:
            t = b.tenants[tenant] = _Tenant(tag=b.vtime)
        elif not t.live:
            t.tag = max(t.tag, b.vtime)  # back from idle: no credit for the time it sent nothing
        entry = Entry(item, band, tenant, deadline, cost)
        heapq.heappush(t.heap, (deadline, next(self._arrivals), entry))
        t.live += 1
        b.live += 1
        self._live += 1
        return entry

    def remove(self, entry: Entry[T]) -> None:
        """Takes a waiting entry out (cancelled, expired); one already served or removed is left."""
        if entry.gone:
            return
        entry.gone = True
        b = self._bands[entry.band]
        b.tenants[entry.tenant].live -= 1
        b.live -= 1
        self._live -= 1
        self._compact(entry.band, b)

    def pop(self) -> Entry[T] | None:
        """The next entry to serve: the lowest band, its tenant with the smallest virtual start
        tag (ties: tenant name, for a reproducible order), that tenant's earliest deadline."""
        if not self._live:
            return None
        band_key = min(k for k, b in self._bands.items() if b.live)
        b = self._bands[band_key]
        name, t = min(((n, t) for n, t in b.tenants.items() if t.live), key=lambda nt: (nt[1].tag, nt[0]))
        entry = heapq.heappop(t.heap)[2]
        while entry.gone:
            entry = heapq.heappop(t.heap)[2]
        entry.gone = True
        t.live -= 1
        b.live -= 1
        self._live -= 1
        b.vtime = t.tag
        t.tag += entry.cost / self._weight(name)
        self._compact(band_key, b)
        return entry

    def ahead_of(self, band: int, tenant: str) -> float:
        """About how many requests would be served before a new one of `tenant` in `band`: every
        one of the bands before it, the tenant's own, and of each other tenant of the band its
        fair share of the time that takes (what it would be served meanwhile, at most all of it)."""
        ahead = sum(b.live for k, b in self._bands.items() if k < band)
        b = self._bands.get(band)
        if b is None:
            return float(ahead)
        own_t = b.tenants.get(tenant)
        own = own_t.live if own_t is not None else 0
        rounds = (own + 1) / self._weight(tenant)
        others = sum(min(t.live, math.ceil(rounds * self._weight(n))) for n, t in b.tenants.items()
                     if n != tenant and t.live)
        return float(ahead + own + others)

    def _weight(self, tenant: str) -> float:
        return max(self._weight_of(tenant), 1e-6)

    def _compact(self, band_key: int, b: _Band[T]) -> None:
        """Forgets what no longer matters, so the queue does not grow with every tenant ever
        seen: an idle tenant whose tag the band's virtual time has passed (it would restart
        there anyway), with the removed entries its heap still held, and an idle band."""
        if not b.live:
            del self._bands[band_key]
            return
        idle = [(n, t) for n, t in b.tenants.items() if not t.live]
        for n, t in idle:
            t.heap.clear()  # every entry left in it was removed
            if t.tag <= b.vtime:
                del b.tenants[n]
