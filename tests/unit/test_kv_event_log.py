"""A worker's KV event stream: ids, resumption from a bounded buffer, snapshots for late subscribers."""

from __future__ import annotations

import asyncio

from services.worker.kv_event_log import KvEventLog
from services.kv_protocol.events import KvCleared, KvRemoved, KvStored


async def take(log: KvEventLog, from_id: int, batches: int = 1):  # noqa: ANN201
    out = []
    stream = log.subscribe(from_id)
    for _ in range(batches):
        out.append(await asyncio.wait_for(anext(stream), 2))
    await stream.aclose()
    return out


async def test_events_get_increasing_ids_and_resume_after_the_last_seen_id() -> None:
    log = KvEventLog(capacity=10)
    for i in range(5):
        log.append(KvStored(None, ((i, i),)))
    [(events, snapshot)] = await take(log, from_id=3)
    assert not snapshot
    assert [e.event_id for e in events] == [4, 5]


async def test_a_subscriber_behind_the_buffer_gets_a_snapshot_of_current_blocks() -> None:
    log = KvEventLog(capacity=3)
    log.append(KvStored(None, ((1, 11), (2, 12))))
    log.append(KvStored(2, ((3, 13),)))
    log.append(KvRemoved((3,)))
    log.append(KvStored(None, ((4, 14),)))
    log.append(KvStored(None, ((5, 15),)))
    [(events, snapshot)] = await take(log, from_id=0)
    assert snapshot
    assert isinstance(events[0].data, KvCleared)
    stored = [(e.data.parent_hash, e.data.blocks[0]) for e in events[1:]]
    # Shallowest first, so every block's parent is stored before it.
    assert stored == [(None, (1, 11)), (None, (4, 14)), (None, (5, 15)), (1, (2, 12))]
    assert {e.event_id for e in events} == {5}


async def test_a_large_snapshot_comes_in_several_messages_and_only_the_first_starts_over() -> None:
    log = KvEventLog(capacity=2, snapshot_batch=2)
    log.append(KvStored(None, ((1, 11), (2, 12), (3, 13))))
    log.append(KvStored(3, ((4, 14),)))
    log.append(KvStored(None, ((5, 15),)))
    batches = await take(log, from_id=0, batches=3)
    assert [flag for _, flag in batches] == [True, False, False]
    events = [e for batch, _ in batches for e in batch]
    assert isinstance(events[0].data, KvCleared) and len(events) == 6
    assert all(len(batch) <= 2 for batch, _ in batches)


async def test_live_events_follow_the_backlog() -> None:
    log = KvEventLog()
    log.append(KvStored(None, ((1, 1),)))
    stream = log.subscribe(0)
    first, _ = await asyncio.wait_for(anext(stream), 2)
    log.append(KvRemoved((1,)))
    second, _ = await asyncio.wait_for(anext(stream), 2)
    await stream.aclose()
    assert [e.event_id for e in first] == [1] and [e.event_id for e in second] == [2]


async def test_a_subscriber_too_slow_for_its_queue_is_cut_off_rather_than_blocking_the_engine() -> None:
    log = KvEventLog(subscriber_queue=4)
    stream = log.subscribe(0)
    pending = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    for i in range(20):
        log.append(KvStored(None, ((i, i),)))  # never blocks, whatever the subscriber does
    batch, _ = await asyncio.wait_for(pending, 2)
    rest = [b async for b, _ in stream]
    seen = [e.event_id for e in batch] + [e.event_id for b in rest for e in b]
    assert seen == sorted(seen) and len(seen) < 20  # it ends early; it resumes from seen[-1]
