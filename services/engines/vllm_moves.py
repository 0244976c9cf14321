"""Handing a vLLM engine's running requests over (a drain): re-prefilled from its own prefix cache.

vLLM cannot keep a running request's blocks for a peer: the one way to stop it, an abort,
finishes it FINISHED_ABORTED, and its NixlConnector (`request_finished`) keeps blocks for a
remote read only for a request that finished LENGTH_CAPPED or STOPPED; nothing lowers a running
request's max_tokens. But an aborted request's full blocks stay in vLLM's prefix cache until
something evicts them, and a draining worker admits nothing that would. So a request moves in
three steps:
1. its stream stops at its next output (everything before it has gone to the client; the tap,
   which could deliver outputs past this generator, is closed first) and vLLM aborts it;
2. its tokens so far (prompt and output) are prefilled again as a prefill worker's request
   (`do_remote_decode`, one output token, discarded): the prefix cache serves every full block,
   so only the last, partial block is computed (fewer than block_size tokens), and vLLM's
   NixlConnector holds the blocks for a peer;
3. the request ends with a MOVED output whose `kv_pull` is that prefill's parameters: the next
   worker pulls them as it pulls a remote prefill.
A request whose re-prefill fails moves without KV (recomputed where it goes).

Whether a pull happened is not visible from here (vLLM's scheduler frees the blocks in its own
process): a handoff counts as unpulled for as long as its puller may still be pulling
(`pull_deadline_s` of the KV's size, the deadline a mocker puller keeps).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field, replace

from services.engines.base import EngineOutput, EngineRequest, FinishReason, PrefillResult, RowTap, pull_deadline_s

log = logging.getLogger(__name__)

# The longest a request takes to reach its next output (a long prefill in the same step).
NEXT_OUTPUT_S = 60.0
# KV bytes per token where the model's config.json does not state its attention at the top (a
# vision-language model's text config): an 8B model's.
FALLBACK_KV_BYTES_PER_TOKEN = 128 << 10


@dataclass(eq=False)
class Live:
    """A request in flight, and what its client has of its output."""

    request: EngineRequest
    tap: RowTap | None
    generated: list[int] = field(default_factory=list)
    # Set by `move_out`: resolved once the request is handed over (True) or ended by itself (False).
    moving: asyncio.Future[bool] | None = None


class VllmMoves:
    def __init__(self, kv_bytes_per_token: Callable[[], int]) -> None:
        """`kv_bytes_per_token`: read at the first handoff (a worker that never moves anything
        never reads it)."""
        self._read_kv_bytes = kv_bytes_per_token
        self._kv_bytes_per_token = 0
        self._live: dict[str, Live] = {}
        # When each handoff's pull may have ended at the latest (monotonic).
        self._pulls_end: list[float] = []

    def track(self, request: EngineRequest, tap: RowTap | None) -> Live:
        live = Live(request, tap)
        self._live[request.request_id] = live
        return live

    def untrack(self, live: Live) -> None:
        self._live.pop(live.request.request_id, None)
        if live.moving is not None and not live.moving.done():
            live.moving.set_result(False)

    async def move_out(self, request_ids: Collection[str] | None) -> int:
        """Asks each request (of `request_ids`, or all) to stop at its next output and waits
        until each one is handed over or ended; how many were handed over."""
        loop = asyncio.get_running_loop()
        asked = [live for rid, live in self._live.items()
                 if live.moving is None and (request_ids is None or rid in request_ids)]
        for live in asked:
            live.moving = loop.create_future()
            if live.tap is not None:
                live.tap.close()  # its outputs come through the request's generator from now on
        if not asked:
            return 0
        done = await asyncio.wait_for(asyncio.gather(*(live.moving for live in asked if live.moving)), NEXT_OUTPUT_S)
        return sum(done)

    async def hand_over(self, live: Live, prefill: Callable[[EngineRequest], Awaitable[PrefillResult]]) -> EngineOutput:
        """Step 2 and 3 (above), once the request's stream is closed."""
        request = live.request
        tokens = request.token_ids + live.generated
        again = EngineRequest(f"{request.request_id}>moved", tokens,
                              replace(request.sampling, max_tokens=1, min_tokens=0, logprobs=None, structured=None),
                              lora_name=request.lora_name, media=request.media)
        params = None
        try:
            result = await prefill(again)
            params = result.kv_pull
            nbytes = len(tokens) * self._bytes_per_token()
            self._pulls_end.append(time.monotonic() + pull_deadline_s(nbytes))
            log.info("request %s: handed over after %d tokens; %d of its %d tokens computed again (its last, "
                     "partial block)", request.request_id, len(live.generated), len(tokens) - result.cached_tokens,
                     len(tokens))
        except Exception as exc:  # noqa: BLE001 - any failure: it moves without KV, recomputed there
            log.warning("request %s: its KV could not be held for a move (%s); it moves without it",
                        request.request_id, exc)
        if live.moving is not None and not live.moving.done():
            live.moving.set_result(True)
        return EngineOutput([], FinishReason.MOVED, kv_pull=params)

    def _bytes_per_token(self) -> int:
        if not self._kv_bytes_per_token:
            try:
                self._kv_bytes_per_token = self._read_kv_bytes()
            except (KeyError, ValueError, TypeError, OSError):
                self._kv_bytes_per_token = FALLBACK_KV_BYTES_PER_TOKEN
        return self._kv_bytes_per_token

    def unpulled(self) -> int:
        now = time.monotonic()
        self._pulls_end = [t for t in self._pulls_end if t > now]
        return len(self._pulls_end)
