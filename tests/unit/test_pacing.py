"""Stream pacing (services/worker/pacing.py), in-process: tokens that come faster than the interval
ride together, in order, none lost; slow tokens pass one by one; the first is never held; errors
and cancellation reach the engine's generator."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from services.engines.base import EngineOutput, TokenLogprobs
from services.worker.pacing import paced


async def _engine(count: int, gap_s: float, log: list[str] | None = None,
                  fail_at: int | None = None) -> AsyncIterator[EngineOutput]:
    try:
        for i in range(count):
            if fail_at == i:
                raise ValueError("the engine refused the request")
            await asyncio.sleep(gap_s)
            yield EngineOutput([i], "length" if i == count - 1 else None, cached_tokens=16,
                               logprobs=[TokenLogprobs(i, -0.5)])
    finally:
        if log is not None:
            log.append("engine closed")


async def _collect(outputs: AsyncIterator[EngineOutput]) -> list[tuple[float, EngineOutput]]:
    return [(time.monotonic(), out) async for out in outputs]


def test_fast_tokens_ride_together_in_order_and_none_is_lost() -> None:
    got = asyncio.run(_collect(paced(_engine(200, 0.0), 0.02)))
    outs = [out for _, out in got]
    assert [t for out in outs for t in out.token_ids] == list(range(200))
    assert [lp.token_id for out in outs for lp in out.logprobs or []] == list(range(200))
    assert len(outs) < 50, "at most one message per interval"
    assert outs[-1].finish_reason == "length" and all(o.finish_reason is None for o in outs[:-1])
    assert all(o.cached_tokens == 16 for o in outs)


def test_slow_tokens_pass_one_by_one() -> None:
    got = asyncio.run(_collect(paced(_engine(5, 0.03), 0.005)))
    assert [out.token_ids for _, out in got] == [[0], [1], [2], [3], [4]]


def test_slow_tokens_need_no_buffering_task() -> None:
    async def run() -> set[str]:
        names: set[str] = set()
        async for _ in paced(_engine(5, 0.03), 0.005):
            names |= {t.get_name() for t in asyncio.all_tasks()}
        return names

    assert "pace engine outputs" not in asyncio.run(run())


def test_neither_the_first_nor_the_last_tokens_wait_out_the_interval() -> None:
    """With a 10 s interval, a 3-token answer still arrives at once (in at most two messages)."""

    async def run() -> tuple[float, list[tuple[float, EngineOutput]]]:
        started = time.monotonic()
        return started, await _collect(paced(_engine(3, 0.0), 10.0))

    started, got = asyncio.run(run())
    assert [t for _, out in got for t in out.token_ids] == [0, 1, 2] and len(got) <= 2
    assert got[-1][0] - started < 5.0


def test_interval_zero_adds_no_wait() -> None:
    async def run() -> float:
        started = time.monotonic()
        await _collect(paced(_engine(50, 0.001), 0.0))
        return time.monotonic() - started

    assert asyncio.run(run()) < 50 * 0.001 + 0.5


def test_an_engine_error_reaches_the_consumer() -> None:
    async def run() -> None:
        async for _ in paced(_engine(10, 0.0, fail_at=3), 0.005):
            pass

    with pytest.raises(ValueError, match="refused"):
        asyncio.run(run())


def test_closing_the_stream_ends_the_engines_generation() -> None:
    log: list[str] = []

    async def run() -> None:
        stream = paced(_engine(1000, 0.001, log), 0.005)
        async for _ in stream:
            break
        await stream.aclose()

    asyncio.run(run())
    assert log == ["engine closed"]
