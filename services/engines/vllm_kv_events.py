"""vLLM's KV cache events (ZMQ PUB, msgpack batches) turned into the engine-neutral KV events.

vLLM publishes `[topic, seq, msgpack(KVEventBatch)]`; block hashes may be ints or bytes
(sha256 prefix caching), so they are folded to u64. The local (tokens) hash is recomputed from
the block's token ids with the mesh's Dynamo-compatible hash, so the router can match prompts;
blocks a LoRA adapter computed (vLLM names it in `lora_name`) are hashed with that adapter's seed,
as the router hashes that adapter's prompts, so they never match the base model's or another's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio

from services.kv_protocol.hashing import SequenceHash, adapter_seed, block_hash_with_media, local_block_hashes
from services.kv_protocol.media import digest_of_uuid
from services.kv_protocol.events import KvCleared, KvEventData, KvRemoved, KvStored
from services.kv_protocol.tier import Tier

log = logging.getLogger(__name__)


def fold_hash(value: int | bytes) -> SequenceHash:
    """vLLM's block hash as a u64 sequence hash (sha256 prefix caching gives bytes: the first 8)."""
    if isinstance(value, bytes):
        return SequenceHash(int.from_bytes(value[:8], "little"))
    return SequenceHash(value & 0xFFFF_FFFF_FFFF_FFFF)


def tier_of(medium: str | None) -> Tier | None:
    """vLLM's `medium` on an event as the mesh's tier: GPU (or none, from engines without
    offloading) is the device, CPU the host; other media (disk) are not tracked (None)."""
    if medium is None or medium.upper() == "GPU":
        return Tier.DEVICE
    if medium.upper() == "CPU":
        return Tier.HOST
    return None


def convert(event: object) -> KvEventData | None:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    if not isinstance(event, (BlockStored, BlockRemoved)):
        return KvCleared() if isinstance(event, AllBlocksCleared) else None
    tier = tier_of(getattr(event, "medium", None))
    if tier is None:
        return None
    if isinstance(event, BlockStored):
        if event.block_size <= 0 or not event.token_ids:
            # vLLM's offloading announces a store without its tokens unless asked to describe it
            # (`self_describing_kv_events`): nothing to hash, so nothing the router could match.
            return None
        lora_name = event.lora_name or ""
        seed = adapter_seed(lora_name)
        locals_ = local_block_hashes(event.token_ids, event.block_size, seed)
        for b, keys in enumerate(getattr(event, "extra_keys", None) or ()):
            images = _images_of(keys)
            if images and b < len(locals_):
                # A block holding images: hashed with them, as the router hashes the prompt.
                size = event.block_size
                locals_[b] = block_hash_with_media(event.token_ids[b * size:(b + 1) * size], seed, images)
        hashes = [fold_hash(h) for h in event.block_hashes]
        if len(locals_) != len(hashes):
            log.warning("vLLM stored event with %d hashes for %d full blocks; skipped", len(hashes), len(locals_))
            return None
        parent = None if event.parent_block_hash is None else fold_hash(event.parent_block_hash)
        return KvStored(parent, tuple(zip(hashes, locals_)), tier, lora_name)
    return KvRemoved(tuple(fold_hash(h) for h in event.block_hashes), tier)


def _images_of(keys: object) -> list[tuple[int, int]]:
    """The images a block's extra keys name, as (digest, offset from the block's start): vLLM
    keys a block by `(identifier, offset)` pairs for the images it holds, the identifier being
    the `multi_modal_uuids` entry the engine gave (media_uuid); other keys (a LoRA name, a
    cache salt) are passed over."""
    images = []
    for key in keys if isinstance(keys, list | tuple) else ():
        if isinstance(key, list | tuple) and len(key) == 2 and isinstance(key[0], str) and isinstance(key[1], int):
            digest = digest_of_uuid(key[0])
            if digest is not None:
                images.append((digest, key[1]))
    return images


class VllmKvEventListener:
    """Subscribes to one engine's publisher and forwards each event, in order, to `sink`."""

    def __init__(self, port: int, sink: Callable[[KvEventData], None]) -> None:
        self.port = port
        self._sink = sink
        self._ctx = zmq.asyncio.Context()
        self._socket = self._ctx.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.setsockopt(zmq.RCVHWM, 100_000)
        # Connecting before the engine binds is fine with ZMQ, and loses no early event.
        self._socket.connect(f"tcp://127.0.0.1:{port}")
        self._task: asyncio.Task[None] | None = None

    @property
    def publisher_endpoint(self) -> str:
        return f"tcp://*:{self.port}"

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="vllm-kv-events")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._socket.close(linger=0)
        self._ctx.term()

    async def _run(self) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while True:
            frames = await self._socket.recv_multipart()
            try:
                batch = decoder.decode(frames[-1])
            except msgspec.DecodeError as exc:
                log.warning("undecodable KV event batch from vLLM: %s", exc)
                continue
            for event in batch.events:
                try:
                    converted = convert(event)
                except Exception:  # noqa: BLE001 - one odd event must not end the worker's event stream
                    log.exception("vLLM KV event %r could not be read; skipped", type(event).__name__)
                    continue
                if converted is not None:
                    self._sink(converted)
