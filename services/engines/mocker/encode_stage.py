"""The mocker's part in a separate encode stage (E/P/D), with real NIXL transfers.

On an encode worker, `encode` runs one image through the simulated encoder (its patches at the
profile's encode cost; nothing for an image in its encoder cache), then holds the image's
features in its NIXL arena: one row per placeholder token, `hidden_size * 2` bytes a row (the
language model's width in 16-bit values), content a function of the image's digest, so a pull of
the wrong image fails its checksum. On the worker that prefills, `to_encode` names the images it
would encode itself, and `take_features` reads one's features over NIXL into its encoder cache:
its step then encodes nothing for it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable

from services.engines.base import EncodedImage, EngineBusy, EngineRequest, MediaInput, distinct_images
from services.engines.mocker.encoder import ImageEncoder
from services.engines.mocker.kv_transfer import KvTransferError, NixlKvEndpoint
from services.engines.mocker.timing import TimingModel
from services.kv_protocol.hashing import SequenceHash, chain_from, local_block_hashes

log = logging.getLogger(__name__)

# A row of features when the model states no width (hidden_size 0): a small model's.
DEFAULT_FEATURE_BYTES_PER_TOKEN = 2048
# Images waiting for the encoder at most; past that an encode is refused as busy (its caller
# encodes in place), rather than waiting out its deadline in a queue nobody bounds.
MAX_WAITING = 64


class EncodeStage:
    def __init__(self, encoder: ImageEncoder, endpoint: NixlKvEndpoint | None, timing: TimingModel,
                 hidden_size: int, cached_prefix: Callable[[EngineRequest], int]) -> None:
        """`cached_prefix`: the prompt tokens a request would find cached on this engine now."""
        self._encoder = encoder
        self._endpoint = endpoint
        self._timing = timing
        self._row_bytes = hidden_size * 2 or DEFAULT_FEATURE_BYTES_PER_TOKEN
        self._cached_prefix = cached_prefix
        # One encoder: images queue for it, as on one accelerator.
        self._busy = asyncio.Lock()
        self._waiting = 0
        # Each hold its own key: the same image asked for twice (two requests, or one retried)
        # gets two slices, each freed by its own pull.
        self._holds = itertools.count()

    def to_encode(self, request: EngineRequest) -> list[MediaInput]:
        if not request.media or self._endpoint is None or self._encoder.vision is None:
            return []
        cached = self._cached_prefix(request)
        return distinct_images(item for item in request.media
                               if item.span.end > cached and not self._encoder.holds(item.span.digest))

    async def encode(self, request_id: str, item: MediaInput) -> EncodedImage:
        if self._endpoint is None:
            raise NotImplementedError("this worker was started without KV transfer (--kv-transfer nixl): it can "
                                      "hand no features over")
        self._encoder.check((item,))
        if self._waiting >= MAX_WAITING:
            raise EngineBusy(f"{self._waiting} images are waiting for this encoder")
        self._waiting += 1
        try:
            async with self._busy:
                patches = self._encoder.encode_patches(item)
                await asyncio.sleep(self._timing.encode_seconds(patches))
        finally:
            self._waiting -= 1
        key = f"{request_id}/image-{item.span.digest:016x}/{next(self._holds)}"
        params = await self._endpoint.hold(key, feature_rows(item), "", self._row_bytes)
        return EncodedImage(params, cached=not patches)

    async def take_features(self, item: MediaInput, features: dict) -> None:
        if self._endpoint is None:
            raise KvTransferError("this worker was started without KV transfer (--kv-transfer nixl)")
        nbytes, seconds = await self._endpoint.pull(features)
        if nbytes != item.span.length * self._row_bytes:
            raise KvTransferError(f"features of {nbytes} bytes for an image of {item.span.length} tokens")
        self._encoder.taken(item.span.digest)
        log.debug("features of image %016x: %d bytes in %.1f ms", item.span.digest, nbytes, seconds * 1000)


def feature_rows(item: MediaInput) -> list[int]:
    """The ids the synthetic features are built from: the digest's two halves, then the rest of
    the image's span (so their size and content are the image's)."""
    digest = item.span.digest
    return [digest & 0xFFFF_FFFF, digest >> 32, *range(max(0, item.span.length - 2))][: item.span.length]


def cached_prefix_tokens(request: EngineRequest, block_size: int, seed: int,
                         prefix_blocks: Callable[[list[SequenceHash]], int]) -> int:
    """The tokens of `request`'s prompt in cached blocks (`prefix_blocks` of its chained hashes)."""
    chain = chain_from(local_block_hashes(request.token_ids, block_size, seed, request.spans()))
    return prefix_blocks(chain) * block_size
