"""An engine request's output channel and its row tap (engines/output_channel.py): outputs in
order; the tap takes only plain outputs, only while the reader waits with nothing unread, and
closes for good once outputs come faster than the pacing interval, or once pacing merges."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from services.engines.base import EngineOutput, FinishReason, TokenLogprobs
from services.engines.base import RowTap
from services.engines.output_channel import OutputChannel
from services.worker.pacing import paced
from tests.unit.clocks import advance, virtual_time


async def reader(channel: OutputChannel, seen: list[tuple[str, list[int]]]) -> None:
    while True:
        out = await channel.get()
        seen.append(("read", out.token_ids))
        if out.finish_reason is not None:
            return


async def test_the_tap_takes_plain_outputs_only_while_the_reader_waits_with_nothing_unread() -> None:
    seen: list[tuple[str, list[int]]] = []
    tap = RowTap()
    channel = OutputChannel(16, tap)
    channel.put(EngineOutput([1]))  # nobody reads yet: buffered
    task = asyncio.create_task(reader(channel, seen))
    await asyncio.sleep(0)
    tap.open(lambda ids: seen.append(("tap", ids)), interval_s=0.0)
    channel.put(EngineOutput([2]))  # the reader waits: the tap
    channel.put(EngineOutput([3], logprobs=[TokenLogprobs(3, -0.1)]))  # logprobs: the reader
    channel.put(EngineOutput([4]))  # behind an unread output: the reader, in order
    await asyncio.sleep(0)
    channel.put(EngineOutput([5]))  # the reader waits again: the tap
    channel.put(EngineOutput([6], FinishReason.LENGTH))  # a last output: the reader
    await asyncio.wait_for(task, 5)
    assert seen == [("read", [1]), ("tap", [2]), ("read", [3]), ("read", [4]), ("tap", [5]), ("read", [6])]


async def test_outputs_faster_than_the_interval_close_the_tap_for_good() -> None:
    seen: list[tuple[str, list[int]]] = []
    tap = RowTap()
    channel = OutputChannel(16, tap)
    task = asyncio.create_task(reader(channel, seen))
    await asyncio.sleep(0)
    tap.open(lambda ids: seen.append(("tap", ids)), interval_s=3600.0)
    channel.put(EngineOutput([1]))  # sooner than the interval: the reader (where pacing merges)
    await asyncio.sleep(0)
    tap._last -= 7200  # as if an hour had passed: the tap stays closed all the same
    channel.put(EngineOutput([2]))
    await asyncio.sleep(0)
    channel.put(EngineOutput([3], FinishReason.STOP))
    await asyncio.wait_for(task, 5)
    assert seen == [("read", [1]), ("read", [2]), ("read", [3])]


async def test_a_closed_tap_and_no_tap_read_everything() -> None:
    for tap in (RowTap(), None):
        seen: list[tuple[str, list[int]]] = []
        channel = OutputChannel(4, tap)
        task = asyncio.create_task(reader(channel, seen))
        await asyncio.sleep(0)
        channel.put(EngineOutput([1]))
        channel.put(EngineOutput([2], FinishReason.STOP))
        await asyncio.wait_for(task, 5)
        assert seen == [("read", [1]), ("read", [2])]


def test_more_outputs_than_the_bound_is_a_bug_that_raises() -> None:
    channel = OutputChannel(2)
    channel.put(EngineOutput([1]))
    channel.put(EngineOutput([2]))
    assert channel.full()
    with pytest.raises(RuntimeError, match="more than 2 outputs"):
        channel.put(EngineOutput([3]))


@virtual_time
async def test_pacing_that_starts_merging_closes_the_tap_so_nothing_overtakes_its_buffer() -> None:
    """Two outputs already waiting when the tap opens: pacing merges the second (it came early)
    and holds it; a third output after the interval must not overtake it through the tap.
    In virtual time: the tap and the pacing measure on the loop's clock."""
    clock = asyncio.get_running_loop().time
    tap = RowTap(clock)
    channel = OutputChannel(16, tap)

    async def engine() -> AsyncGenerator[EngineOutput, None]:
        while True:
            out = await channel.get()
            yield out
            if out.finish_reason is not None:
                return

    tapped: list[list[int]] = []
    channel.put(EngineOutput([1]))
    channel.put(EngineOutput([2]))
    outputs = paced(engine(), 0.05, tap.close, clock)
    got = [(await anext(outputs)).token_ids]
    tap.open(tapped.append, 0.05)
    reading = asyncio.ensure_future(anext(outputs))  # reads [2] at once: early, so pacing merges
    await advance(0.08)
    assert reading.done()  # [2] went out once the interval had passed
    channel.put(EngineOutput([3]))  # past the interval since the tap opened
    channel.put(EngineOutput([4], FinishReason.STOP))
    got.append((await reading).token_ids)
    got += [out.token_ids async for out in outputs]
    assert tapped == []
    assert [t for ids in got for t in ids] == [1, 2, 3, 4]
