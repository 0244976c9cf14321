"""A worker's KV event stream: ids, a bounded replay buffer, and a full dump for late subscribers.

The engine reports cache changes; this log numbers them (monotonic `event_id`), keeps the last
`capacity` for subscribers that resume after a broken stream, and tracks the blocks currently
cached so a subscriber whose id is too old can start over from a snapshot.

Ids restart with every process, so the log has an `incarnation` (random, new with each log): a
subscriber resuming with an id of another incarnation gets a snapshot, not another process's
events under its old numbering. A subscription that has nothing to send for `heartbeat_s` sends
an empty batch, so a subscriber can tell a quiet worker from a silent stream.

The drill `silence()` (SIGUSR2 on a worker process toggles it, see runtime.py) holds every
subscription's output, heartbeats included, while the log goes on numbering and tracking events:
the stream stays open but says nothing, as if the publisher hung. `publish()` lets the held
events flow again (a subscriber whose queue filled meanwhile resumes from its id, or a snapshot).
"""

from __future__ import annotations

import asyncio
import secrets
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from services.kv_protocol.events import KvCleared, KvEventData, KvRemoved, KvStored
from services.kv_protocol.tier import Tier
from services.kv_protocol.hashing import LocalBlockHash, SequenceHash


@dataclass(frozen=True, slots=True)
class NumberedEvent:
    event_id: int
    data: KvEventData


# A subscription that sent nothing for this long sends an empty batch (routers call a stream that
# sent nothing for three of these silent).
HEARTBEAT_S = 1.0


class KvEventLog:
    def __init__(self, capacity: int = 65536, subscriber_queue: int = 8192, snapshot_batch: int = 16384,
                 heartbeat_s: float = HEARTBEAT_S) -> None:
        """`snapshot_batch`: events per message of a snapshot (one block each, about 30 bytes on the
        wire), so a large cache's snapshot stays far below gRPC's 4 MB message limit."""
        self._snapshot_batch = snapshot_batch
        self._heartbeat_s = heartbeat_s
        self.incarnation = secrets.randbits(63) + 1  # never 0, the subscriber's "none yet"
        self._publishing = asyncio.Event()
        self._publishing.set()
        self._buffer: deque[NumberedEvent] = deque(maxlen=capacity)
        self._last_id = 0
        # (block hash, tier) -> (parent hash, local hash, LoRA adapter). A block may sit in both
        # tiers (vLLM keeps the device copy of what it offloads).
        self._blocks: dict[tuple[SequenceHash, Tier], tuple[SequenceHash | None, LocalBlockHash, str]] = {}
        # Per block hash, its depth in its chain, while either tier holds it.
        self._depth: dict[SequenceHash, int] = {}
        self._subscribers: set[asyncio.Queue[NumberedEvent | None]] = set()
        self._subscriber_queue = subscriber_queue

    @property
    def last_event_id(self) -> int:
        return self._last_id

    @property
    def silenced(self) -> bool:
        return not self._publishing.is_set()

    def silence(self) -> None:
        """The drill: subscriptions say nothing (no events, no heartbeats) until `publish`."""
        self._publishing.clear()

    def publish(self) -> None:
        self._publishing.set()

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
        blocks, depths = self._blocks, self._depth
        if isinstance(data, KvStored):
            parent = data.parent_hash
            depth = 0 if parent is None else depths.get(parent, 0) + 1
            for block_hash, local in data.blocks:
                blocks[(block_hash, data.tier)] = (parent, local, data.lora_name)
                depths[block_hash] = depth
                parent = block_hash
                depth += 1
        elif isinstance(data, KvRemoved):
            other = Tier.HOST if data.tier == Tier.DEVICE else Tier.DEVICE
            for block_hash in data.block_hashes:
                if blocks.pop((block_hash, data.tier), None) is not None and (block_hash, other) not in blocks:
                    depths.pop(block_hash, None)
        elif isinstance(data, KvCleared):
            blocks.clear()
            depths.clear()

    def snapshot(self) -> list[NumberedEvent]:
        """The current cache as `cleared` plus stored events, all carrying the current id.

        Blocks go shallowest first, so each one's parent is stored before it whichever tier
        holds either (a block that moved to host memory after its child is younger than it)."""
        events = [NumberedEvent(self._last_id, KvCleared())]
        depths = self._depth
        items = sorted(self._blocks.items(), key=lambda item: depths[item[0][0]])
        for (block_hash, tier), (parent, local, lora_name) in items:
            events.append(NumberedEvent(self._last_id, KvStored(parent, ((block_hash, local),), tier, lora_name)))
        return events

    async def subscribe(self, from_event_id: int, snapshot: bool = False, incarnation: int = 0,
                        ) -> AsyncIterator[tuple[list[NumberedEvent], bool]]:
        """Yields (events, is_snapshot) batches after `from_event_id`, then live ones (or an empty
        heartbeat batch after `heartbeat_s` without any), forever.

        A snapshot comes first when asked for, when `incarnation` (that of `from_event_id`; 0 for
        none) is another log's, or when the id is older than the buffer. The first batch comes at
        once, even when it is empty: it tells the subscriber it has caught up with everything the
        worker cached when it subscribed."""
        queue: asyncio.Queue[NumberedEvent | None] = asyncio.Queue(maxsize=self._subscriber_queue + 1)
        self._subscribers.add(queue)
        getter: asyncio.Task[NumberedEvent | None] | None = None
        try:
            await self._publishing.wait()  # the drill: held until published (no deadline by design)
            oldest = self._buffer[0].event_id if self._buffer else self._last_id + 1
            # Everything up to `sent` is delivered by the backlog or snapshot; later events are
            # already in (or will reach) the queue. Fixed before yielding: the consumer may
            # resume only after more events were appended.
            sent = self._last_id
            resumable = incarnation in (0, self.incarnation) and not snapshot
            if resumable and (from_event_id + 1 >= oldest or from_event_id >= self._last_id):
                yield [e for e in self._buffer if e.event_id > from_event_id], False
            else:
                # The first batch tells the subscriber to start over; the rest add to it.
                dump = self.snapshot()
                for i in range(0, len(dump), self._snapshot_batch):
                    yield dump[i : i + self._snapshot_batch], i == 0
            while True:
                # One getter kept across heartbeats: cancelling a `get` on timeout could lose an event.
                getter = getter or asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter}, timeout=self._heartbeat_s)
                await self._publishing.wait()
                if not done:
                    yield [], False
                    continue
                event, getter = getter.result(), None
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
            if getter is not None:
                getter.cancel()
            self._subscribers.discard(queue)
