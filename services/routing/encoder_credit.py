"""What a worker's encoder cache is worth to a prompt with images.

A worker whose engine keeps an image's features (its encoder cache, by the image's digest) need
not encode that image again, even where the KV blocks holding its tokens are gone (evicted, or
the same screenshot behind another prefix). Workers report the digests their encoder cache
holds (`LoadMetrics.encoder_cache`: in a load stream's first report and whenever the set
changes), and for a short while the router adds the images of each prompt it sends one
(worker_images.py), so a screenshot resent at once finds its worker. For each candidate, the
prompt's images it holds there count as

    ENCODER_HIT_WEIGHT x (the image's tokens after the worker's cached prefix) / block_size

cached blocks: an image entirely in cached blocks needs no encoding anyway, and one that is not
saves its encoding, which is worth a share of prefilling its tokens. That share is the weight: a
ViT of ~600M parameters encodes an image's patches for about a third of what an 8B model's
prefill of its tokens costs, the mocker's default profile for about as much (2 ms + 15 us a
patch against ~60 us a token), so half a block per block of image tokens. A worker that reports
no encoder cache (vLLM, whose encoder cache is not visible outside the engine) gets nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence

from services.kv_protocol.media import MediaSpan
from services.routing.worker_pool import WorkerState

# What a block of an image's tokens whose features a worker keeps is worth against a cached block.
ENCODER_HIT_WEIGHT = 0.5


def encoder_blocks(workers: Iterable[WorkerState], media: Sequence[MediaSpan], device: Mapping[Hashable, int],
                   host: Mapping[Hashable, int], block_size: int) -> dict[str, float]:
    """Per worker whose encoder cache holds some of the prompt's images, their worth in cached
    blocks (`device`, `host`: the prompt's blocks each worker holds on its device, and after them
    in host memory)."""
    out: dict[str, float] = {}
    if not media:
        return out
    for worker in workers:
        images = worker.images
        if not images.reports:
            continue
        wid = worker.info.instance_id
        start = (device.get(wid, 0) + host.get(wid, 0)) * block_size
        seen: set[int] = set()
        tokens = 0
        for span in media:
            if span.end <= start or span.digest in seen or not images.keeps(span.digest):
                continue  # in cached blocks already, not held, or the same image again (encoded once)
            seen.add(span.digest)
            tokens += span.end - max(start, span.offset)
        if tokens:
            out[wid] = ENCODER_HIT_WEIGHT * tokens / block_size
    return out
