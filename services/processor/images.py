"""A prompt's images: opened, named by their bytes, and given the placeholder tokens their
features take in the prompt.

The chat template writes one image token where each image stands (the model's own template, as
vLLM renders it); the model's Hugging Face processor widens that token for the image (how many
tokens an image becomes depends on the model and the image's size; vLLM asks the same
processor), and each image's widening is its span. The result is the prompt exactly as the
engine's processor expands it, so routing, hashing and the context check count the tokens the
engine computes.
"""

from __future__ import annotations

import io
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gen.kvmesh.v1 import common_pb2
from services.engines.model_facts import VisionFacts
from services.kv_protocol.media import media_digest
from services.processor.prompt_errors import PromptError

# What an engine decodes: the formats every image client sends (Anthropic's four).
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "GIF": "image/gif", "WEBP": "image/webp"}
# An image with more pixels is refused before anything decodes it (a small file can declare a
# huge canvas: a decompression bomb). 20 megapixels: past a 5K screenshot (14.7), 60 MB decoded.
MAX_PIXELS = 20_000_000
# Images whose widening (their placeholder tokens) is kept.
WIDENED_KEPT = 256


@dataclass(frozen=True, slots=True)
class PromptImage:
    data: bytes
    media_type: str
    width: int
    height: int
    digest: int


def open_image(data: bytes, param: str, decoded: Callable[[int], bool] | None = None) -> PromptImage:
    """The image in `data`, checked to be one an engine can decode; PromptError naming `param`.
    `decoded`: whether the image of a digest was decoded whole before (these very bytes: a
    screenshot an agent resends every turn is not decoded again)."""
    from PIL import Image, UnidentifiedImageError

    digest = media_digest(data)
    try:
        with Image.open(io.BytesIO(data)) as image:
            kind, (width, height) = image.format, image.size
            if kind in FORMATS and width * height <= MAX_PIXELS and not (decoded is not None and decoded(digest)):
                # Decoded whole here, so a damaged file (a JPEG cut short passes any header
                # check) is this request's 400, not an engine's failure later.
                image.load()
    except UnidentifiedImageError:
        raise PromptError("the image is not a PNG, JPEG, GIF or WebP image", param=param) from None
    except Exception as exc:  # PIL raises many kinds for a damaged file
        raise PromptError(f"the image cannot be read: {' '.join(str(exc).split())[:200]}", param=param) from None
    if kind not in FORMATS:
        raise PromptError(f"images of format {kind} are not taken: send PNG, JPEG, GIF or WebP", param=param)
    if width * height > MAX_PIXELS:
        raise PromptError(f"the image is {width}x{height} pixels; at most {MAX_PIXELS} pixels are taken", param=param)
    return PromptImage(data, FORMATS[kind], width, height, digest)


class ImagePlaceholders:
    """How a model's prompt holds images: the one image token its chat template writes per image,
    and what the model's processor widens that token to for a given image (a run of image tokens,
    with the markers some models put around them: Idefics3's `<fake_token_around_image>`)."""

    def __init__(self, model_dir: str, vision: VisionFacts) -> None:
        from transformers import AutoProcessor

        self.vision = vision
        # The PIL image processors: the torchvision ones need a torchvision CPU hosts lack.
        self._hf: Any = AutoProcessor.from_pretrained(model_dir, backend="pil")
        self._marker = str(getattr(self._hf, "image_token", "<image>"))
        # The same screenshot comes back turn after turn: its widening is kept by its digest.
        # Prompts with images are tokenized in worker threads: the lock keeps the order whole.
        self._widened: OrderedDict[int, list[int]] = OrderedDict()
        self._lock = threading.Lock()

    def holds(self, digest: int) -> bool:
        """Whether the image of `digest` was widened, so decoded whole, lately."""
        with self._lock:
            return digest in self._widened

    def expand(self, ids: list[int], images: Sequence[PromptImage]) -> tuple[list[int], list[common_pb2.MediaItem]]:
        """The rendered prompt with each image token widened for its image, and each image with
        the span its widening takes."""
        token = self.vision.image_token_id
        marks = [i for i, t in enumerate(ids) if t == token]
        if len(marks) != len(images):
            raise PromptError(f"the chat template placed {len(marks)} image tokens for {len(images)} images",
                              param="messages")
        out: list[int] = []
        media: list[common_pb2.MediaItem] = []
        start = 0
        for mark, image in zip(marks, images, strict=True):
            out.extend(ids[start:mark])
            widened = self._widen(image)
            span = common_pb2.MediaSpan(digest=image.digest, offset=len(out), length=len(widened))
            media.append(common_pb2.MediaItem(span=span, data=image.data, media_type=image.media_type,
                                              width=image.width, height=image.height))
            out.extend(widened)
            start = mark + 1
        out.extend(ids[start:])
        return out, media

    def _widen(self, image: PromptImage) -> list[int]:
        with self._lock:
            widened = self._widened.get(image.digest)
            if widened is not None:
                self._widened.move_to_end(image.digest)
                return widened
        from PIL import Image

        try:
            with Image.open(io.BytesIO(image.data)) as opened:
                rgb = opened.convert("RGB")
            encoded = self._hf(text=self._marker, images=[[rgb]], add_special_tokens=False)
        except Exception as exc:  # PIL and the model's processor raise many kinds for an odd image
            raise PromptError(f"the model's processor cannot take the image: {' '.join(str(exc).split())[:200]}",
                              param="messages") from None
        widened = [int(t) for t in encoded["input_ids"][0]]
        if self.vision.image_token_id not in widened:
            raise PromptError("the model's processor gave the image no image tokens", param="messages")
        with self._lock:
            self._widened[image.digest] = widened
            if len(self._widened) > WIDENED_KEPT:
                self._widened.popitem(last=False)
        return widened
