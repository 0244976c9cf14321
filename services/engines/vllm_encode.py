"""vLLM's part in the encode stage (E/P/D): image features shared through a directory.

vLLM moves encoder outputs between its instances with an encoder-cache connector. On a CPU host
only its ECExampleConnector runs (its CPU connector needs the V2 model runner, which needs
Triton): the producer (an encode worker's engine, run encoder-only) writes each image's features
to `<dir>/<identifier>/encoder_cache.safetensors`, and a consumer (a worker that prefills) loads
them from there instead of encoding, or encodes the image itself when no file is there. The
identifier is the image's `media_uuid`, so a file is that image's by construction (vLLM trusts
the id as given). The directory is one host's, or a filesystem the workers share; the producer
keeps it bounded (the oldest images' files go past MAX_STORED).
"""

from __future__ import annotations

import asyncio
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.engines.base import EncodedImage, EngineRequest, MediaInput, Sampling, distinct_images
from services.engines.model_facts import VisionFacts
from services.engines.vllm_images import vllm_prompt
from services.kv_protocol.media import MediaSpan, media_uuid

FEATURES_FILE = "encoder_cache.safetensors"
# Images whose features the producer keeps on disk (a few MB each on a real model), and how
# many it writes between two prunes of the oldest.
MAX_STORED = 4096
PRUNE_EVERY = 64


@dataclass(frozen=True)
class EncoderCacheShare:
    directory: str
    # This engine writes the features (an encode worker's); else it reads them.
    producer: bool

    def transfer_config(self) -> dict[str, Any]:
        """vLLM's `ec_transfer_config` (as verified on CPU: the connector keeps no device buffer)."""
        return {"ec_connector": "ECExampleConnector", "ec_role": "ec_producer" if self.producer else "ec_consumer",
                "ec_connector_extra_config": {"shared_storage_path": self.directory}}

    def file_of(self, digest: int) -> Path:
        return Path(self.directory) / media_uuid(digest) / FEATURES_FILE

    def holds(self, digest: int) -> bool:
        return self.file_of(digest).is_file()

    def to_encode(self, request: EngineRequest) -> list[MediaInput]:
        """A consumer's images with no features in the directory yet, each once."""
        if self.producer:
            return []
        return distinct_images(item for item in request.media if not self.holds(item.span.digest))

    def taken(self, item: MediaInput, features: dict) -> None:
        """The producer said it wrote them: the consumer's engine loads them when it prefills."""
        if self.producer or not Path(str(features.get("file", ""))).is_file():
            raise FileNotFoundError(f"no features of image {item.span.digest:016x} in {self.directory} (is it a "
                                    f"directory the encode workers and this worker share?)")


class FeatureWriter:
    """A producer's encodings (the engine builds one for a producer's share only): one image
    through the encoder-only engine, its file checked."""

    def __init__(self, share: EncoderCacheShare, vision: VisionFacts | None) -> None:
        self._share = share
        self._vision = vision
        self._written = 0

    async def encode(self, llm: Any, request_id: str, item: MediaInput) -> EncodedImage:
        from vllm import SamplingParams

        path = self._share.file_of(item.span.digest)
        if path.is_file():
            os.utime(path.parent)  # recently used: the last to be pruned
            return EncodedImage({"file": str(path)}, cached=True)
        if self._vision is None:
            raise ValueError("this model takes text only: its config has no vision encoder")
        # The image alone: its one image token (vLLM widens it), the pixels and the digest's id.
        alone = MediaInput(MediaSpan(item.span.digest, 0, 1), item.data, item.media_type, item.width, item.height)
        one = EngineRequest(request_id, [self._vision.image_token_id], Sampling(), media=(alone,))
        prompt = await vllm_prompt(one, self._vision)
        # An encoder-only engine ends the request once its prompt is consumed: nothing to read.
        async for _ in llm.generate(prompt, SamplingParams(max_tokens=1), request_id):
            pass
        if not path.is_file():
            raise RuntimeError(f"vLLM wrote no features for image {item.span.digest:016x} to {path.parent}")
        self._written += 1
        if self._written % PRUNE_EVERY == 0:
            await asyncio.to_thread(prune, self._share.directory)
        return EncodedImage({"file": str(path)})


def prune(directory: str, keep: int = MAX_STORED) -> int:
    """Removes the oldest images' features past `keep`; returns how many it removed."""
    try:
        entries = [(e.stat().st_mtime, e.path) for e in os.scandir(directory) if e.is_dir()]
    except FileNotFoundError:
        return 0
    entries.sort()
    stale = entries[: max(0, len(entries) - keep)]
    for _, path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return len(stale)
