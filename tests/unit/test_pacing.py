"""Stream pacing (services/worker/pacing.py), in-process: tokens that come faster than the interval
ride together, in order, none lost; slow tokens pass one by one; the first is never held; errors
and cancellation reach the engine's generator.

On a virtual-time loop (tests/unit/clocks.py), with pacing measuring on the loop's clock: the
engine's gaps and the pacing's waits take no wall time, and every time measured is exact."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.engines.base import EngineOutput, TokenLogprobs
from services.worker.pacing import paced
from tests.unit.clocks import run_in_virtual_time


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


def _paced(engine: AsyncIterator[EngineOutput], interval_s: float) -> AsyncIterator[EngineOutput]:
    """`paced` measuring on the running loop's clock (virtual here)."""
    return paced(engine, interval_s, clock=asyncio.get_running_loop().time)


async def _collect(outputs: AsyncIterator[EngineOutput]) -> list[tuple[float, EngineOutput]]:
    loop = asyncio.get_running_loop()
    return [(loop.time(), out) async for out in outputs]


async def _paced_collect(engine: AsyncIterator[EngineOutput], interval_s: float) -> list[tuple[float, EngineOutput]]:
    return await _collect(_paced(engine, interval_s))


def test_fast_tokens_ride_together_in_order_and_none_is_lost() -> None:
    # 200 tokens 1 ms apart, paced at 20 ms: 0.2 s of virtual time.
    got = run_in_virtual_time(_paced_collect(_engine(200, 0.001), 0.02))
    outs = [out for _, out in got]
    assert [t for out in outs for t in out.token_ids] == list(range(200))
    assert [lp.token_id for out in outs for lp in out.logprobs or []] == list(range(200))
    # The first at once, then one message per interval with what came meanwhile, the last as it came.
    assert [len(out.token_ids) for out in outs] == [1] + [20] * 9 + [19], "at most one message per interval"
    assert [t for t, _ in got] == pytest.approx([0.001 + 0.02 * i for i in range(10)] + [0.2])
    assert outs[-1].finish_reason == "length" and all(o.finish_reason is None for o in outs[:-1])
    assert all(o.cached_tokens == 16 for o in outs)


def test_slow_tokens_pass_one_by_one() -> None:
    got = run_in_virtual_time(_paced_collect(_engine(5, 0.03), 0.005))
    assert [out.token_ids for _, out in got] == [[0], [1], [2], [3], [4]]
    assert [round(t, 6) for t, _ in got] == [0.03, 0.06, 0.09, 0.12, 0.15]  # each as it came


def test_slow_tokens_need_no_buffering_task() -> None:
    async def run() -> set[str]:
        names: set[str] = set()
        async for _ in _paced(_engine(5, 0.03), 0.005):
            names |= {t.get_name() for t in asyncio.all_tasks()}
        return names

    assert "pace engine outputs" not in run_in_virtual_time(run())


def test_neither_the_first_nor_the_last_tokens_wait_out_the_interval() -> None:
    """With a 10 s interval, a 3-token answer still arrives at once (in at most two messages)."""
    got = run_in_virtual_time(_paced_collect(_engine(3, 0.0), 10.0))
    assert [t for _, out in got for t in out.token_ids] == [0, 1, 2] and len(got) <= 2
    assert got[-1][0] == 0.0  # no time passed at all


def test_interval_zero_adds_no_wait() -> None:
    got = run_in_virtual_time(_paced_collect(_engine(50, 0.001), 0.0))
    assert [out.token_ids for _, out in got] == [[i] for i in range(50)]
    assert got[-1][0] == pytest.approx(50 * 0.001)  # the engine's own gaps, nothing added


def test_an_engine_error_reaches_the_consumer() -> None:
    async def run() -> None:
        async for _ in _paced(_engine(10, 0.0, fail_at=3), 0.005):
            pass

    with pytest.raises(ValueError, match="refused"):
        run_in_virtual_time(run())


def test_closing_the_stream_ends_the_engines_generation() -> None:
    log: list[str] = []

    async def run() -> None:
        stream = _paced(_engine(1000, 0.001, log), 0.005)
        async for _ in stream:
            break
        await stream.aclose()

    run_in_virtual_time(run())
    assert log == ["engine closed"]
