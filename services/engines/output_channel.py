"""One request's engine outputs on their way from the engine's step to the request's generator,
and the tap that lets a step hand plain outputs straight to the session that sends them.

An engine's step produces an output for each running request. Read through per-request
generators, every output wakes its request's task and climbs a chain of generators to the
worker's session outbox: at hundreds of streams that is most of a worker's CPU. A `RowTap`, once
its consumer opens it, takes an output with tokens and nothing else (no finish, no logprobs)
where the step makes it and puts its tokens in the outbox as a row, with no wake-up at all.

Order is kept because the tap takes an output only while the request's generator waits with
nothing unread (every output before it has gone through the chain, which has no buffer between
the generator and the outbox while the tap is open). Pacing is kept too: an output that comes
sooner than `interval_s` after the previous one closes the tap for good and takes the chain,
where pacing merges what comes fast (worker/pacing.py).
"""

from __future__ import annotations

import asyncio
from collections import deque

from services.engines.base import EngineOutput, RowTap


class OutputChannel:
    """A request's outputs in order, from the engine's step (`put`, never blocks) to its generator
    (`get`). Bounded by construction: a step puts at most one output per request, and a request
    makes at most max_tokens outputs and one end; `put` past `bound` is a bug and raises."""

    __slots__ = ("_items", "_waiter", "_bound", "tap")

    def __init__(self, bound: int, tap: RowTap | None = None) -> None:
        self._items: deque[EngineOutput] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._bound = bound
        self.tap = tap

    def put(self, out: EngineOutput) -> None:
        items = self._items
        if not items:
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                tap = self.tap
                if tap is not None and tap.take(out):
                    return
                waiter.set_result(None)
        if len(items) >= self._bound:
            raise RuntimeError(f"an engine request got more than {self._bound} outputs")
        items.append(out)

    def full(self) -> bool:
        return len(self._items) >= self._bound

    async def get(self) -> EngineOutput:
        items = self._items
        while not items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return items.popleft()
