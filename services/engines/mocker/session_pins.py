"""The mocker's session pins: an agent session's KV kept across the gap between its turns.

When a request of a session (`EngineRequest.session`) finishes, the chain of its full blocks
(prompt and output) is pinned for the session's `retain_s`: the device's LRU cannot evict it.
The session's next request replaces the pin: on arrival its prefix is loaded back from the host
tier into free device blocks (a prefetch, pinned with it; the engine times the transfer so it
overlaps the request's wait in the queue), on admission the pin goes (the request holds the blocks now),
and at its end the longer chain is pinned again. Pins expire `retain_s` after the last of these.

Budgets keep pins from starving the requests that run:
- device: at most `device_budget` pinned blocks. Past it the least recently active sessions are
  demoted, oldest first: their blocks become evictable again, and (with a host tier) are
  protected in it instead, so eviction moves them to host memory and the host tier's own LRU
  cannot drop them while the pin lives. Without a host tier a demoted pin holds nothing and ends.
- host: protected chains add up to at most `host_budget` blocks (the engine: half the host
  tier); past it the sessions demoted longest ago lose their protection (their pin ends) first,
  and a chain longer than the whole budget is not protected at all.
- the engine demotes pins (oldest first) whenever running requests cannot otherwise go on: a
  running sequence would be preempted for a block, or the queue's head does not fit while
  nothing runs. A pin never costs a request its progress, only a wait for blocks running
  requests will free.

Work happens when a session's request arrives, starts or ends, and when a pin expires; a step
pays one look at the expiry heap's head.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

from services.engines.base import SessionPinLoad
from services.engines.mocker.block_manager import BlockManager
from services.kv_protocol.hashing import SequenceHash


@dataclass(slots=True)
class _Pin:
    # The run of the session's chain it keeps, from the root.
    chain: list[SequenceHash]
    # The device blocks it pins; empty once demoted.
    blocks: list[int]
    expires_at: float
    # Tells its expiry entry from those of the pins it replaced.
    serial: int


class SessionPins:
    def __init__(self, blocks: BlockManager, device_budget: int, host_budget: int) -> None:
        self._bm = blocks
        self.device_budget = device_budget
        self.host_budget = host_budget if blocks.host_blocks else 0
        # Least recently active first, in each: pins on the device, and demoted pins protected in
        # the host tier (in the order they were demoted).
        self._device: OrderedDict[str, _Pin] = OrderedDict()
        self._host: OrderedDict[str, _Pin] = OrderedDict()
        self._protected = 0  # the sum of the protected chains' lengths: within host_budget
        # (expires_at, serial, session id); entries of replaced pins are skipped when they surface.
        self._expiry: list[tuple[float, int, str]] = []
        self._serial = 0
        self.prefetched_blocks_total = 0
        self.demoted_blocks_total = 0

    def __len__(self) -> int:
        return len(self._device) + len(self._host)

    def load(self) -> SessionPinLoad:
        return SessionPinLoad(len(self), self._bm.pinned_blocks, self.device_budget,
                              self._bm.host_protected_blocks, self.prefetched_blocks_total,
                              self.demoted_blocks_total)

    def next_expiry(self) -> float | None:
        """When the next live pin expires (None: no pin), the entries of pins gone before it dropped."""
        expiry = self._expiry
        while expiry and self._pin_of(expiry[0]) is None:
            heapq.heappop(expiry)
        return expiry[0][0] if expiry else None

    # -- a session's requests ------------------------------------------------------------------

    def arrived(self, session_id: str, chain: list[SequenceHash], retain_s: float, now: float) -> int:
        """A request of the session entered the queue with the full blocks `chain`: loads the part
        of its prefix that waits in host memory back into free device blocks now, and pins the
        prefix there (within the budget, as any pin) until the request starts. Returns the blocks
        loaded."""
        bm = self._bm
        loaded = 0
        if bm.host_blocks:
            hit = bm.cached_prefix_blocks(chain)
            if bm.host_prefix_blocks(chain, hit):
                loaded = bm.prefetch(chain, len(chain))
        if loaded:
            self.prefetched_blocks_total += loaded
            self.kept(session_id, chain, retain_s, now)
        else:  # nothing to move: it stays as it is, as the most recently active
            pin = self._device.get(session_id) or self._host.get(session_id)
            if pin is not None:
                self._touch(session_id, pin, retain_s, now)
        return loaded

    def started(self, session_id: str) -> None:
        """The session's request holds its blocks now: its pin goes."""
        pin = self._device.pop(session_id, None) or self._host.pop(session_id, None)
        if pin is not None:
            self._release(pin)

    def kept(self, session_id: str, chain: list[SequenceHash], retain_s: float, now: float) -> None:
        """Pins the device run of `chain` for the session (a request of it ended, or its prefix
        was brought back), replacing its pin, then brings the pins within their budgets."""
        blocks = self._bm.pin(chain)  # before the old pin goes: their shared blocks stay put
        self.started(session_id)
        if not blocks:
            return
        self._serial += 1
        pin = _Pin(chain[:len(blocks)], blocks, now + retain_s, self._serial)
        self._device[session_id] = pin
        self._push_expiry(session_id, pin)
        self._fit_device()

    # -- budgets and time ----------------------------------------------------------------------

    def expire(self, now: float) -> None:
        """Ends the pins whose time is up."""
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            entry = heapq.heappop(expiry)
            pins = self._pin_of(entry)
            if pins is not None:
                self._release(pins.pop(entry[2]))

    def _pin_of(self, entry: tuple[float, int, str]) -> OrderedDict[str, _Pin] | None:
        """Where the pin an expiry entry stands for is, or None if it was replaced or released."""
        for pins in (self._device, self._host):
            pin = pins.get(entry[2])
            if pin is not None and pin.serial == entry[1]:
                return pins
        return None

    def yield_device(self) -> bool:
        """Demotes the least recently active device pin, for a request that needs its blocks;
        False when no pin holds device blocks."""
        if not self._device:
            return False
        self._demote(*self._device.popitem(last=False))
        return True

    def _fit_device(self) -> None:
        while self._bm.pinned_blocks > self.device_budget and self._device:
            self._demote(*self._device.popitem(last=False))

    def _demote(self, session_id: str, pin: _Pin) -> None:
        """Device pin -> protected in the host tier, or nothing without one."""
        self._bm.unpin(pin.blocks)
        self.demoted_blocks_total += len(pin.blocks)
        pin.blocks = []
        if len(pin.chain) > self.host_budget:
            return  # no host tier, or a chain longer than its budget: only the LRU decides now
        self._bm.protect(pin.chain)
        self._protected += len(pin.chain)
        self._host[session_id] = pin
        while self._protected > self.host_budget:
            self._release(self._host.popitem(last=False)[1])

    def _release(self, pin: _Pin) -> None:
        if pin.blocks:
            self._bm.unpin(pin.blocks)
        else:
            self._bm.unprotect(pin.chain)
            self._protected -= len(pin.chain)

    def _touch(self, session_id: str, pin: _Pin, retain_s: float, now: float) -> None:
        (self._device if pin.blocks else self._host).move_to_end(session_id)
        self._serial += 1
        pin.serial, pin.expires_at = self._serial, max(pin.expires_at, now + retain_s)
        self._push_expiry(session_id, pin)

    def _push_expiry(self, session_id: str, pin: _Pin) -> None:
        heapq.heappush(self._expiry, (pin.expires_at, pin.serial, session_id))
        if len(self._expiry) > 2 * len(self) + 64:  # replaced pins' entries: bounded by the live ones
            live = [(p.expires_at, p.serial, s) for pins in (self._device, self._host) for s, p in pins.items()]
            heapq.heapify(live)
            self._expiry = live
