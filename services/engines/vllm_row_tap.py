"""vLLM's own output loop hands a request's plain outputs to a RowTap (output_channel.py).

vLLM's AsyncLLM already runs one loop per engine step over the engine core's outputs (its
`output_handler`); it puts each request's output into that request's collector and wakes the
request's `generate()` task, which then climbs the worker's chain of generators to the session
outbox: per stream per step. Here the collector's `put` is wrapped so that, while the request's
task waits in the collector's `get` with nothing unread, an output carrying tokens and nothing
else goes to the tap in that same loop, with no wake-up; every
other output (the last, one with logprobs or KV transfer parameters, or one while something is
unread) goes the collector's way, after everything before it. The tap closes itself when
outputs come faster than the stream's pacing (RowTap.take).

This reaches into AsyncLLM's output processor (`external_req_ids`, `request_states[...].queue`),
internals of the pinned vLLM: where they are not as expected, nothing is tapped and the request
goes the per-request way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from services.engines.base import EngineOutput, RowTap

log = logging.getLogger(__name__)


def tap_request(llm: Any, request_id: str, tap: RowTap, seen: Callable[[list[int]], object] | None = None) -> bool:
    """Wraps the collector of `request_id` (one sequence, n=1) so plain outputs may go to `tap`
    (`seen` hears the tokens of each); False where the collector cannot be found."""
    processor: Any = getattr(llm, "output_processor", None)
    internal = getattr(processor, "external_req_ids", {}).get(request_id)
    state = processor.request_states.get(internal[0]) if internal and len(internal) == 1 else None
    collector = getattr(state, "queue", None)
    if collector is None or not all(hasattr(collector, name) for name in ("output", "put", "get")):
        log.debug("request %s: vLLM's output collector not found; outputs go per request", request_id)
        return False
    put, get = collector.put, collector.get
    # The request's generate() task waits in the collector's `get` (not somewhere up the
    # worker's chain with an output still in hand): only then may an output skip the chain.
    waiting = [False]

    async def tracked_get() -> Any:
        waiting[0] = True
        try:
            return await get()
        finally:
            waiting[0] = False

    def tapped(output: Any) -> None:
        if (waiting[0] and collector.output is None and not getattr(output, "finished", True)
                and not getattr(output, "kv_transfer_params", None)):
            completion = output.outputs[0]
            ids = list(completion.token_ids)
            if completion.logprobs is None and tap.take(EngineOutput(ids, cached_tokens=int(output.num_cached_tokens or 0))):
                if seen is not None:
                    seen(ids)
                return
        put(output)

    collector.put = tapped
    collector.get = tracked_get
    return True
