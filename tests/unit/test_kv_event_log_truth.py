"""The worker's side of a trustworthy KV event stream (kv_event_log.py): an incarnation that makes
a resumption across a restart start over, a snapshot on request, heartbeats, and the silence drill."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from services.kv_protocol.events import KvCleared, KvStored
from services.kv_protocol.hashing import LocalBlockHash, SequenceHash
from services.worker.kv_event_log import KvEventLog


def store(log: KvEventLog, h: int) -> None:
    log.append(KvStored(None, ((SequenceHash(h), LocalBlockHash(h)),)))


async def first(log: KvEventLog, from_id: int, **kw: object) -> tuple[list[object], bool]:
    stream = log.subscribe(from_id, **kw)  # type: ignore[arg-type]
    try:
        return await asyncio.wait_for(anext(stream), 2)  # type: ignore[return-value]
    finally:
        await stream.aclose()


async def test_a_resumption_with_another_incarnations_id_gets_a_snapshot() -> None:
    log = KvEventLog()
    store(log, 1)
    store(log, 2)
    events, snapshot = await first(log, 1, incarnation=log.incarnation)
    assert not snapshot and len(events) == 1
    events, snapshot = await first(log, 1, incarnation=log.incarnation + 1)
    assert snapshot and isinstance(events[0].data, KvCleared) and len(events) == 3  # type: ignore[attr-defined]
    assert KvEventLog().incarnation != log.incarnation


async def test_a_subscriber_may_ask_for_a_snapshot() -> None:
    log = KvEventLog()
    store(log, 1)
    _, snapshot = await first(log, 1, snapshot=True)
    assert snapshot


# Loop turns to let a subscription run: far more than the few a heartbeat takes at heartbeat_s=0
# (the timer fires on the next turn, the wait returns on the one after).
TURNS = 50
# Only against a hang: what is due comes within a few loop turns.
DEADLINE_S = 10.0


async def turns(n: int = TURNS) -> None:
    """Runs the event loop `n` turns: nothing here waits on a clock, only on what is ready."""
    for _ in range(n):
        await asyncio.sleep(0)


async def next_events(stream: AsyncIterator[tuple[list[Any], bool]]) -> list[Any]:
    """The next batch that carries events (heartbeats skipped)."""
    async with asyncio.timeout(DEADLINE_S):
        while True:
            events, _ = await anext(stream)
            if events:
                return events


async def test_an_idle_subscription_sends_heartbeats_and_the_drill_silences_them() -> None:
    # heartbeat_s=0: a subscription with nothing to send sends a heartbeat at every turn of the
    # loop it is given, so `TURNS` turns without one are the drill's doing, not a slow clock.
    log = KvEventLog(heartbeat_s=0)
    stream = log.subscribe(0)
    try:
        assert await asyncio.wait_for(anext(stream), DEADLINE_S) == ([], False)  # caught up
        nxt = asyncio.ensure_future(anext(stream))
        await turns()
        assert nxt.done() and nxt.result() == ([], False)  # a heartbeat
        log.silence()
        nxt = asyncio.ensure_future(anext(stream))
        await turns()
        assert not nxt.done()  # nothing, not even a heartbeat
        store(log, 1)
        await turns()
        assert not nxt.done()  # nor the event
        log.publish()
        first, _ = await asyncio.wait_for(nxt, DEADLINE_S)
        # The held turn may end in the heartbeat that was due when the drill held it; the event follows.
        events = first or await next_events(stream)
        assert [e.event_id for e in events] == [1]  # held, not lost
    finally:
        await stream.aclose()


@pytest.mark.parametrize("silenced", [False, True])
def test_silence_is_a_toggle_the_log_reports(silenced: bool) -> None:
    log = KvEventLog()
    if silenced:
        log.silence()
    assert log.silenced is silenced
