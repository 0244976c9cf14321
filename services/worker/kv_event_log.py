"""A worker's KV event stream: ids, a bounded replay buffer, and a full dump for late subscribers.

The engine reports cache changes; this log numbers them (monotonic `event_id`), keeps the last
`capacity` for subscribers that resume after a broken stream, and tracks the blocks currently
cached so a subscriber whose id is too old can start over from a snapshot.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from services.engines.base import KvCleared, KvEventData, KvRemoved, KvStored
from services.mesh.hashing import LocalBlockHash, SequenceHash

# Whole snapshots are cut into batches so no single message grows past the gRPC limit.
SNAPSHOT_BATCH_BLOCKS = 4096


@dataclass(frozen=True, slots=True)
class NumberedEvent:
    event_id: int
    data: KvEventData


class KvEventLog:
    def __init__(self, capacity: int = 65536, subscriber_queue: int = 8192) -> None:
        self._buffer: deque[NumberedEvent] = deque(maxlen=capacity)
        self._last_id = 0
        # block hash -> (parent hash, local hash), in store order (parents first).
        self._blocks: dict[SequenceHash, tuple[SequenceHash | None, LocalBlockHash]] = {}
        self._subscribers: set[asyncio.Queue[NumberedEvent | None]] = set()
        self._subscriber_queue = subscriber_queue

    @property
    def last_event_id(self) -> int:
        return self._last_id

    def append(self, data: KvEventData) -> None:
        self._last_id += 1
        event = NumberedEvent(self._last_id, data)
        self._buffer.append(event)
        self._track(data)
        for queue in list(self._subscribers):
            if queue.qsize() >= self._subscriber_queue:
                # A subscriber this far behind resumes from its last id (or a snapshot) instead;
                # the queue keeps one place free for this end-of-stream mark.
                self._subscribers.discard(queue)
                queue.put_nowait(None)
                continue
            queue.put_nowait(event)

    def _track(self, data: KvEventData) -> None:
        if isinstance(data, KvStored):
            parent = data.parent_hash
            for block_hash, local in data.blocks:
                self._blocks[block_hash] = (parent, local)
                parent = block_hash
        elif isinstance(data, KvRemoved):
            for block_hash in data.block_hashes:
                self._blocks.pop(block_hash, None)
        elif isinstance(data, KvCleared):
            self._blocks.clear()

    def snapshot(self) -> list[NumberedEvent]:
        """The current cache as `cleared` plus stored events, all carrying the current id."""
        events = [NumberedEvent(self._last_id, KvCleared())]
        items = list(self._blocks.items())
        for i in range(0, len(items), SNAPSHOT_BATCH_BLOCKS):
            for block_hash, (parent, local) in items[i : i + SNAPSHOT_BATCH_BLOCKS]:
                events.append(NumberedEvent(self._last_id, KvStored(parent, ((block_hash, local),))))
        return events

    async def subscribe(self, from_event_id: int) -> AsyncIterator[tuple[list[NumberedEvent], bool]]:
        """Yields (events, is_snapshot) batches after `from_event_id`, then live ones, forever.

        The first batch comes at once, even when it is empty: it tells the subscriber it has
        caught up with everything the worker cached when it subscribed."""
        queue: asyncio.Queue[NumberedEvent | None] = asyncio.Queue(maxsize=self._subscriber_queue + 1)
        self._subscribers.add(queue)
        try:
            oldest = self._buffer[0].event_id if self._buffer else self._last_id + 1
            # Everything up to `sent` is delivered by the backlog or snapshot; later events are
            # already in (or will reach) the queue. Fixed before yielding: the consumer may
            # resume only after more events were appended.
            sent = self._last_id
            if from_event_id + 1 >= oldest or from_event_id >= self._last_id:
                yield [e for e in self._buffer if e.event_id > from_event_id], False
            else:
                yield self.snapshot(), True
            while True:
                event = await queue.get()
                if event is None:
                    return
                if event.event_id <= sent:
                    continue
                batch = [event]
                while not queue.empty():
                    nxt = queue.get_nowait()
                    if nxt is None:
                        yield batch, False
                        return
                    batch.append(nxt)
                sent = batch[-1].event_id
                yield batch, False
        finally:
            self._subscribers.discard(queue)
