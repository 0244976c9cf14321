"""The mocker's image encoder: which images a step must encode, and what that costs.

An image is encoded in the step that prefills its prompt, unless the engine need not: its
placeholder tokens all lie in blocks already cached (the KV holds what its features produced),
or it encoded the same image (by digest) lately and still holds its features (the encoder cache,
as vLLM keeps one). Each encoding costs by the image's patches (the profile's encode terms).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from services.engines.base import ImageLoad, MediaInput
from services.engines.model_facts import VisionFacts

# Images whose features the engine keeps (vLLM sizes its encoder cache in tokens; a count is
# what the simulation needs).
DEFAULT_ENCODER_CACHE_IMAGES = 64


@dataclass
class EncoderCounts:
    """Since start: images encoded, found in the encoder cache, needing no encoding at all
    (their tokens were in cached KV blocks), and whose features came from an encode worker."""

    encoded: int = 0
    encoder_cache_hits: int = 0
    kv_hits: int = 0
    taken: int = 0


class ImageEncoder:
    def __init__(self, vision: VisionFacts | None, capacity: int = DEFAULT_ENCODER_CACHE_IMAGES) -> None:
        self.vision = vision
        self._capacity = capacity
        self._cache: OrderedDict[int, None] = OrderedDict()
        self.counts = EncoderCounts()

    def load(self) -> ImageLoad | None:
        """Its counts; None for a text model."""
        if self.vision is None:
            return None
        c = self.counts
        return ImageLoad(c.encoded, c.encoder_cache_hits, c.kv_hits, c.taken, frozenset(self._cache))

    def check(self, media: tuple[MediaInput, ...]) -> None:
        if media and self.vision is None:
            raise ValueError("this model takes text only: its config has no vision encoder")

    def holds(self, digest: int) -> bool:
        return digest in self._cache

    def step_patches(self, media: tuple[MediaInput, ...], computed_from: int) -> list[int]:
        """The patches of each image a step that computes the prompt from token `computed_from` on
        must encode (the images it encodes are then cached)."""
        patches: list[int] = []
        for item in media:
            if item.span.end <= computed_from:
                self.counts.kv_hits += 1
            else:
                patches += self.encode_patches(item)
        return patches

    def encode_patches(self, item: MediaInput) -> list[int]:
        """[the image's patches] when it must be encoded (it is cached from then on); [] when its
        features are in the cache."""
        digest = item.span.digest
        if digest in self._cache:
            self._cache.move_to_end(digest)
            self.counts.encoder_cache_hits += 1
            return []
        assert self.vision is not None  # check() refused media for a text model
        self.counts.encoded += 1
        self._keep(digest)
        return [self.vision.patches(item.width, item.height)]

    def taken(self, digest: int) -> None:
        """Features an encode worker encoded are in the cache now."""
        self.counts.taken += 1
        self._keep(digest)

    def _keep(self, digest: int) -> None:
        self._cache[digest] = None
        self._cache.move_to_end(digest)
        if len(self._cache) > self._capacity:
            self._cache.popitem(last=False)
