"""Handing running requests over with their KV (a drain: `Engine.move_out`).

At a step boundary the engine takes every sequence out of its schedule. The KV of each one's
tokens so far (prompt, and every token generated, whose output has gone out already) is written
to the NIXL arena for the next worker to pull, as a prefill worker holds a prompt's, and its
blocks stay taken until that pull, as a real engine's stay while a peer reads them. A sequence
with no blocks (still waiting, or preempted) is handed over without KV: the next worker
computes it, as this one would have. One within FINISH_HERE_TOKENS of its max_tokens stays and
finishes here (the drain waits for it).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Collection

from services.engines.base import EngineOutput, FinishReason
from services.engines.mocker.kv_transfer import NixlKvEndpoint
from services.engines.mocker.sequence import Seq

log = logging.getLogger(__name__)

# A destination pulls within milliseconds of the handoff; KV nobody came for by then is freed.
MOVE_HOLD_S = 10.0
# The longest a step runs before its boundary (a long prefill on a slow profile).
BOUNDARY_WAIT_S = 60.0
# A request this close to its max_tokens finishes here: a few steps cost less than a move.
FINISH_HERE_TOKENS = 16


class MoveOut:
    """The engine's requests on their way out: asked for at a step boundary, then held."""

    def __init__(self, endpoint: NixlKvEndpoint | None, free_blocks: Callable[[list[int]], None]) -> None:
        self._endpoint = endpoint
        self._free = free_blocks
        self._asked: asyncio.Future[list[Seq]] | None = None
        # The requests asked for (None: all), by the pending `take`.
        self._only: Collection[str] | None = None
        # Handed over with KV that no destination has pulled yet.
        self.unpulled = 0

    async def take(self, wake: Callable[[], None], request_ids: Collection[str] | None = None) -> list[Seq]:
        """Every sequence in the schedule (or those of `request_ids`), taken out at the step
        loop's next boundary (`wake` starts an idle loop). One take at a time."""
        if self._asked is not None:
            raise RuntimeError("a move is under way already")
        self._asked = asyncio.get_running_loop().create_future()
        self._only = request_ids
        asked = self._asked
        wake()
        return await asyncio.wait_for(asyncio.shield(asked), BOUNDARY_WAIT_S)

    def at_boundary(self, running: list[Seq], waiting: deque[Seq]) -> None:
        """Called by the step loop between steps: hands what it runs and queues to a `take`."""
        asked = self._asked
        if asked is None:
            return
        self._asked = None
        only = self._only
        seqs = [seq for seq in (*running, *waiting)
                if not seq.done and (only is None or seq.request.request_id in only)
                and seq.request.sampling.max_tokens - seq.generated > FINISH_HERE_TOKENS]
        taken = set(seqs)
        running[:] = [seq for seq in running if seq not in taken]
        kept = [seq for seq in waiting if seq not in taken]
        waiting.clear()
        waiting.extend(kept)
        for seq in seqs:
            seq.done = True  # its generator's end must not free blocks a pull may still read
        if not asked.done():
            asked.set_result(seqs)

    async def hand_over(self, seqs: list[Seq]) -> None:
        """Holds every sequence's KV at once (each is written on a worker thread): a short one's
        handoff does not wait for a long one's."""
        await asyncio.gather(*(self._hand_over(seq) for seq in seqs))

    async def _hand_over(self, seq: Seq) -> None:
        params = await self._hold(seq) if seq.blocks else None
        seq.out.put(EngineOutput([], FinishReason.MOVED, seq.cached_tokens, kv_pull=params))

    async def _hold(self, seq: Seq) -> dict | None:
        """Holds the sequence's KV for a pull, its blocks taken until then; None (blocks freed)
        when it cannot be held."""
        blocks, seq.blocks = seq.blocks, []
        rid = seq.request.request_id
        if self._endpoint is None:
            self._free(blocks)
            return None

        def pulled() -> None:
            self._free(blocks)
            self.unpulled -= 1

        self.unpulled += 1
        try:
            return await self._endpoint.hold(rid, seq.tokens, seq.request.lora_name, expires_s=MOVE_HOLD_S,
                                             on_release=pulled, with_metadata=True)
        except Exception as exc:  # noqa: BLE001 - no room in the arena, or the copy failed: moved without KV
            self.unpulled -= 1
            self._free(blocks)
            log.warning("request %s: its KV (%d tokens) could not be held for a move (%s); it moves without it",
                        rid, len(seq.tokens), exc)
            return None
