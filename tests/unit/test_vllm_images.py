"""Images at the vLLM engine's edges, in-process: a prompt's widened images collapse back to the one
image token vLLM widens itself, with the digests as vLLM's ids for them; a KV event's image keys
(those ids and offsets) give the very local hashes the router computes from the prompt."""

from __future__ import annotations

import asyncio
import io

import pytest
from PIL import Image

from services.engines.base import EngineRequest, MediaInput, Sampling
from services.engines.model_facts import VisionFacts
from services.engines.vllm_images import vllm_prompt
from services.kv_protocol.hashing import adapter_seed, local_block_hashes
from services.kv_protocol.media import MediaSpan, digest_of_uuid, media_digest, media_uuid

pytestmark = pytest.mark.vllm  # imports vLLM's event types
IMAGE_TOKEN = 9
VISION = VisionFacts(IMAGE_TOKEN, 14, 112)


@pytest.fixture(scope="module", autouse=True)
def vllm_imported() -> None:
    """vLLM's first import asks `file` about the interpreter (a child process): done before each
    test's guard against starting processes is set (module fixtures come first)."""
    import vllm.distributed.kv_events  # noqa: F401


def png(shade: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (30, 20), (shade, 0, 0)).save(out, "PNG")
    return out.getvalue()


def item(data: bytes, offset: int, length: int) -> MediaInput:
    return MediaInput(MediaSpan(media_digest(data), offset, length), data, "image/png", 30, 20)


def test_each_image_s_span_collapses_to_one_image_token_with_its_digest_as_its_id() -> None:
    a, b = png(1), png(2)
    tokens = [1, 2, *[IMAGE_TOKEN] * 5, 3, *[IMAGE_TOKEN] * 4, 4]
    request = EngineRequest("r", tokens, Sampling(), media=(item(a, 2, 5), item(b, 8, 4)))
    prompt = asyncio.run(vllm_prompt(request, VISION))
    assert prompt["prompt_token_ids"] == [1, 2, IMAGE_TOKEN, 3, IMAGE_TOKEN, 4]
    assert [i.size for i in prompt["multi_modal_data"]["image"]] == [(30, 20), (30, 20)]
    assert prompt["multi_modal_uuids"]["image"] == [media_uuid(media_digest(a)), media_uuid(media_digest(b))]
    assert asyncio.run(vllm_prompt(EngineRequest("t", [1, 2], Sampling()), None)) == {"prompt_token_ids": [1, 2]}


def test_uuids_give_their_digests_back_whatever_vllm_prefixes() -> None:
    digest = media_digest(b"x")
    assert digest_of_uuid(media_uuid(digest)) == digest
    assert digest_of_uuid("my-adapter:" + media_uuid(digest)) == digest
    assert digest_of_uuid("173c9d8f94315aaa7f93978fc8a676192f9bb77ab45d590a732d4ec21d40864e") is None


def test_a_stored_event_with_image_keys_hashes_as_the_router_does() -> None:
    from vllm.distributed.kv_events import BlockStored

    from services.engines.vllm_kv_events import convert

    a, b = media_digest(b"a"), media_digest(b"b")
    tokens = list(range(100, 196))
    spans = [MediaSpan(a, 20, 20), MediaSpan(b, 36, 8)]
    # vLLM's keys per block: None, or (id, offset from the block's start) for each image it holds.
    keys = [None, ([media_uuid(a), 4],), ([media_uuid(a), -12], [media_uuid(b), 4]), None, None, None]
    event = convert(BlockStored(block_hashes=list(range(1, 7)), parent_block_hash=None, token_ids=tokens,
                                block_size=16, lora_id=None, medium="GPU", lora_name=None, extra_keys=keys))
    assert [local for _, local in event.blocks] == local_block_hashes(tokens, 16, adapter_seed(""), spans)
