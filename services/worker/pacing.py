"""How a worker streams a request's tokens: at most one message per pacing interval.

Every hop after the engine (worker -> processor -> frontend -> client) costs per *message*, not
per token. So a stream sends whatever the engine produced since its last message as one message,
and sends again only once `interval` has passed since the last one: tokens that come faster ride
together; a token that comes later than that goes out at once. The first output is never
delayed (it carries the time to first token), nor is the last. On a GPU a decode step takes
longer than the default interval, so a stream of one token per step is sent token by token; a
fast engine (or a zero-compute mocker) is sent in batches, with at most `interval` added to a
token's latency. Interval 0 sends every engine output as it comes. Outputs slower than the
interval are read straight from the engine; only a stream that has something to merge pays for a
task that buffers it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing, nullcontext

from services.engines.base import EngineOutput, TokenLogprobs
from services.mesh.tasks import cancel_and_wait

# Seconds between two messages of one stream, at least (5 ms: 200 messages/s per stream).
DEFAULT_INTERVAL_S = 0.005


def merged(outputs: deque[EngineOutput]) -> EngineOutput:
    """One output for several consecutive ones: their tokens (and logprobs) in order, the last
    one's finish reason and KV-transfer parameters."""
    if len(outputs) == 1:
        return outputs[0]
    tokens: list[int] = []
    logprobs: list[TokenLogprobs] | None = [] if any(o.logprobs for o in outputs) else None
    for out in outputs:
        tokens.extend(out.token_ids)
        if logprobs is not None and out.logprobs:
            logprobs.extend(out.logprobs)
    last = outputs[-1]
    return EngineOutput(tokens, last.finish_reason, max(o.cached_tokens for o in outputs), logprobs,
                        next((o.kv_pull for o in reversed(outputs) if o.kv_pull is not None), None))


async def paced(outputs: AsyncIterator[EngineOutput], interval_s: float,
                on_merge: Callable[[], None] = lambda: None,
                clock: Callable[[], float] = time.monotonic) -> AsyncGenerator[EngineOutput, None]:
    """The engine's outputs, merged so that at most one goes out per `interval_s`.

    While outputs come at least `interval_s` apart (a GPU's decode steps), each goes out as it
    comes, read straight from the engine: there is nothing to merge, and a task in between would
    cost two task switches per token. The first output that comes early hands the stream to
    `_pumped`, which holds it and merges what follows until the interval has passed; `on_merge`
    runs first (from then on outputs wait in a buffer here: a row tap must close). `clock`: what
    the interval is measured on; its seconds are the event loop's (a paced wait is a loop timeout)."""
    async with aclosing(outputs) if isinstance(outputs, AsyncGenerator) else nullcontext():
        last_sent = float("-inf")
        while True:
            out = await anext(outputs, None)
            if out is None:
                return
            now = clock()
            if out.finish_reason is None and now - last_sent < interval_s:
                on_merge()
                async for merged_out in _pumped(outputs, interval_s, out, last_sent, clock):
                    yield merged_out
                return
            last_sent = now
            yield out
            if out.finish_reason is not None:
                return


async def _pumped(outputs: AsyncIterator[EngineOutput], interval_s: float, early: EngineOutput,
                  last_sent: float, clock: Callable[[], float]) -> AsyncGenerator[EngineOutput, None]:
    """Pacing for outputs that come faster than the interval, `early` first.

    A pump task reads the engine into a buffer (bounded by the request's max_tokens, one entry
    per engine output) so the engine never waits for the consumer; closing this generator
    cancels the pump, which ends the engine's generation (the engine aborts the request)."""
    buffer: deque[EngineOutput] = deque([early])
    ready = asyncio.Event()
    # Set once the engine has nothing more to give: a paced wait ends then, so the last tokens
    # are never held back.
    finished = asyncio.Event()
    ended = False
    failure: BaseException | None = None

    async def pump() -> None:
        nonlocal ended, failure
        try:
            async for out in outputs:
                buffer.append(out)
                ready.set()
                if out.finish_reason is not None:
                    finished.set()
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            failure = exc
        finally:
            ended = True
            ready.set()
            finished.set()

    task = asyncio.create_task(pump(), name="pace engine outputs")
    try:
        while True:
            if not buffer and not ended:
                ready.clear()
                await ready.wait()
            wait = interval_s - (clock() - last_sent)
            if wait > 0 and not finished.is_set():
                try:
                    await asyncio.wait_for(finished.wait(), wait)
                except TimeoutError:
                    pass
            if buffer:
                out = merged(buffer)
                buffer.clear()
                last_sent = clock()
                yield out
                if out.finish_reason is not None:
                    return
            elif ended:
                if failure is not None:
                    raise failure
                return
    finally:
        await cancel_and_wait(task)
