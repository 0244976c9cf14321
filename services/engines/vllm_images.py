"""A prompt with images as vLLM takes it.

The mesh's prompt holds each image's placeholders already widened (the processor widens them
with the model's own processor, so routing and hashing count the tokens the engine computes);
vLLM takes one image token per image and widens it itself, and would widen widened ones again.
So each image's span collapses back to its image token here, the images are decoded, and each
goes with its digest as vLLM's id for it (`multi_modal_uuids`): vLLM's encoder cache and the
extra keys of its KV events then name the image as the mesh does (vllm_kv_events.py).
"""

from __future__ import annotations

import asyncio
import io
from typing import Any

from services.engines.base import EngineRequest, MediaInput
from services.engines.model_facts import VisionFacts
from services.kv_protocol.media import media_uuid

# Images one prompt may hold (vLLM's limit_mm_per_prompt, which sizes its encoder budget): the
# gateway's default --max-images.
IMAGES_PER_PROMPT = 32


async def vllm_prompt(request: EngineRequest, vision: VisionFacts | None) -> dict[str, Any]:
    if not request.media:
        return {"prompt_token_ids": list(request.token_ids)}
    if vision is None:
        raise ValueError("this model takes text only: its config has no vision encoder")
    ids: list[int] = []
    start = 0
    for item in request.media:
        ids += request.token_ids[start:item.span.offset]
        ids.append(vision.image_token_id)
        start = item.span.end
    ids += request.token_ids[start:]
    images = await asyncio.to_thread(_decoded, request.media)
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": images},
            "multi_modal_uuids": {"image": [media_uuid(item.span.digest) for item in request.media]}}


def _decoded(media: tuple[MediaInput, ...]) -> list[Any]:
    from PIL import Image

    out = []
    for item in media:
        with Image.open(io.BytesIO(item.data)) as image:
            out.append(image.convert("RGB"))
    return out
