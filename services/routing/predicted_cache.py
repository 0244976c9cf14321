"""A prediction of each worker's device cache from the prompts the router sent it, for workers
whose KV events are off or cannot be trusted (Dynamo's ApproxKvIndexer idea).

Rule: after a prompt is routed to worker w, every full block of it is predicted held by w, for
`ttl_s` from that routing (routing it again renews it), and a worker's prediction holds at most
`max_blocks` blocks, the least recently routed going first (an engine's cache evicts the least
recently used too). A prompt's score on w is the number of its leading blocks w is predicted to
hold, stopping at the first one it does not: engines reuse a prompt's cache from its first block
on, so a block after a gap saves nothing.

Blocks are keyed by a chain of the local hashes (a block with everything before it), so the same
tokens at another position are another block; the chain is Python's tuple hash, not the wire's
sequence hash, as the keys never leave the process and this runs on every routing decision.
Both recording and scoring cost O(blocks of the prompt);
expiry is lazy (a worker's entries are ordered by routing time, and the TTL is the same for all,
so the oldest entries are the first to expire).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence

from services.kv_protocol.hashing import LocalBlockHash

# The defaults of `--prediction-ttl` and `--prediction-max-blocks` (config.py).
DEFAULT_TTL_S = 120.0
DEFAULT_MAX_BLOCKS = 65536
# A block with everything before it, as this process hashes it.
ChainKey = int


def chain_keys(local_hashes: Sequence[LocalBlockHash]) -> list[ChainKey]:
    keys, key = [], 0
    for local in local_hashes:
        key = hash((key, local))
        keys.append(key)
    return keys


class PredictedCache:
    def __init__(self, ttl_s: float, max_blocks: int, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0 or max_blocks < 1:
            raise ValueError(f"ttl_s must be > 0 and max_blocks >= 1, got {ttl_s}, {max_blocks}")
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self._clock = clock
        # Per worker: sequence hash -> when its prediction expires, oldest routing first.
        self._held: dict[Hashable, OrderedDict[ChainKey, float]] = {}

    def routed(self, worker: Hashable, local_hashes: Sequence[LocalBlockHash]) -> None:
        """The prompt with these block hashes was sent to `worker`: its blocks are now predicted there."""
        now = self._clock()
        held = self._held.setdefault(worker, OrderedDict())
        expires = now + self.ttl_s
        for block in chain_keys(local_hashes):
            held[block] = expires
            held.move_to_end(block)
        self._expire(held, now)
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def score(self, worker: Hashable, local_hashes: Sequence[LocalBlockHash]) -> int:
        """The prompt's leading blocks `worker` is predicted to hold."""
        return self.scores((worker,), local_hashes).get(worker, 0)

    def scores(self, workers: Iterable[Hashable], local_hashes: Sequence[LocalBlockHash]) -> dict[Hashable, int]:
        """`score` per worker, those with none left out (as an index's `find_matches` does)."""
        chain: list[ChainKey] | None = None
        out: dict[Hashable, int] = {}
        now = self._clock()
        for worker in workers:
            held = self._held.get(worker)
            if not held:
                continue
            chain = chain if chain is not None else chain_keys(local_hashes)
            matched = 0
            for block in chain:
                expires = held.get(block)
                if expires is None or expires <= now:
                    break
                matched += 1
            if matched:
                out[worker] = matched
        return out

    def block_count(self, worker: Hashable) -> int:
        """Blocks predicted on `worker` now (expired ones dropped first)."""
        held = self._held.get(worker)
        if held is None:
            return 0
        self._expire(held, self._clock())
        return len(held)

    def forget(self, worker: Hashable) -> None:
        self._held.pop(worker, None)

    @staticmethod
    def _expire(held: OrderedDict[ChainKey, float], now: float) -> None:
        while held:
            oldest = next(iter(held.values()))
            if oldest > now:
                return
            held.popitem(last=False)
