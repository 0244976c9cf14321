"""Block hashes are xxh3_64 (seed 1337) over little-endian u32 token ids, exactly as NVIDIA Dynamo
computes them, so the router can score blocks that any Dynamo-compatible engine reports.

Two kinds of hash travel through the mesh, and mixing them up mis-scores silently, so each has
its own type (free at run time: a NewType is a plain int):
- `LocalBlockHash`: the hash of one block's tokens alone. The same tokens hash the same at any
  position; the radix tree keys each level by it (`tokens_hash` in KV events).
- `SequenceHash`: a block's hash as an engine keys its cache, chained from its parent's, so it
  identifies the block *and* everything before it (`block_hash` / `parent_hash` in KV events).

A LoRA adapter computes different KV for the same tokens, so its blocks must never match the base
model's or another adapter's: the local hashes of a prompt run with an adapter use the adapter's
seed (`adapter_seed`) instead of 1337, and every level of the router's tree tells them apart.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Sequence
from typing import NewType, cast

import xxhash

from services.kv_protocol.media import MediaSpan

LocalBlockHash = NewType("LocalBlockHash", int)
SequenceHash = NewType("SequenceHash", int)

KV_HASH_SEED = 1337
# The parent hash chained into a sequence's first block: it has no parent block.
NO_PARENT = 0
_NEEDS_BYTESWAP = sys.byteorder != "little"
# One digest function, typed once per kind of hash: a NewType call per block would cost a Python
# call in the hashing loops for nothing but the type checker.
_local_digest = cast(Callable[[bytes, int], LocalBlockHash], xxhash.xxh3_64_intdigest)
_sequence_digest = cast(Callable[[bytes, int], SequenceHash], xxhash.xxh3_64_intdigest)


def adapter_seed(lora_name: str) -> int:
    """The seed of the local hashes of blocks computed with LoRA adapter `lora_name` ("" for the
    base model: Dynamo's 1337). Derived from the adapter's name, the identity every worker and
    router shares: xxh3_64 of b"kvmesh-lora:" + the UTF-8 name, seeded 1337."""
    if not lora_name:
        return KV_HASH_SEED
    return xxhash.xxh3_64_intdigest(b"kvmesh-lora:" + lora_name.encode(), KV_HASH_SEED)


def block_bytes(tokens: Sequence[int]) -> bytes:
    buf = array("I", tokens)
    if _NEEDS_BYTESWAP:
        buf.byteswap()
    return buf.tobytes()


def local_block_hashes(tokens: Sequence[int], block_size: int, seed: int = KV_HASH_SEED,
                       media: Sequence[MediaSpan] = (), start: int = 0) -> list[LocalBlockHash]:
    """The local hash of every full block of `tokens`; a trailing partial block is not hashed.
    `seed`: `adapter_seed` of the LoRA adapter the blocks were computed with. `media`: the
    prompt's images (media.py): a block that holds any of an image's placeholder tokens hashes
    with the image's digest and its offset from the block's start. `start`: the position of
    `tokens[0]` in the prompt the spans index (a block hashed alone, mid-sequence)."""
    full = len(tokens) - len(tokens) % block_size
    if full == 0:
        return []
    data = block_bytes(tokens[:full])
    step = block_size * 4
    h = _local_digest
    hashes = [h(data[i : i + step], seed) for i in range(0, len(data), step)]
    for span in media:
        first = max(span.offset - start, 0) // block_size
        last = min(span.end - start, full) - 1
        for b in range(first, last // block_size + 1 if last >= 0 else first):
            hashes[b] = h(data[b * step : (b + 1) * step] + _media_bytes(media, start + b * block_size, block_size),
                          seed)
    return hashes


def _media_bytes(media: Sequence[MediaSpan], block_start: int, block_size: int) -> bytes:
    end = block_start + block_size
    return media_key([(span.digest, span.offset - block_start) for span in media
                      if span.offset < end and span.end > block_start])


def media_key(images: Sequence[tuple[int, int]]) -> bytes:
    """What a block folds into its hash for the images it holds, in prompt order: each one's
    digest (u64) and offset from the block's start (i64, negative when the image began in an
    earlier block), little-endian."""
    return b"".join(digest.to_bytes(8, "little") + offset.to_bytes(8, "little", signed=True)
                    for digest, offset in images)


def block_hash_with_media(tokens: Sequence[int], seed: int, images: Sequence[tuple[int, int]]) -> LocalBlockHash:
    """The local hash of one block holding images, given as (digest, offset from the block's
    start): what `local_block_hashes` gives that block (an engine's KV event says as much)."""
    return _local_digest(block_bytes(tokens) + media_key(images), seed)


def chained_block_hashes(tokens: Sequence[int], block_size: int) -> list[SequenceHash]:
    """Hashes that identify a block *and* everything before it, as engines key their caches."""
    return chain_from(local_block_hashes(tokens, block_size))


def chain_from(local_hashes: Sequence[LocalBlockHash], parent: int = NO_PARENT) -> list[SequenceHash]:
    """The sequence hashes of blocks with these local hashes, following the block hashed `parent`
    (a `SequenceHash`, or `NO_PARENT` when the first of them starts the sequence)."""
    out: list[SequenceHash] = []
    for local in local_hashes:
        parent = chain_hash(parent, local)
        out.append(parent)
    return out


def chain_hash(parent: int, local: LocalBlockHash) -> SequenceHash:
    """The sequence hash of a block given its parent's (`NO_PARENT` for a sequence's first block)."""
    return _sequence_digest(parent.to_bytes(8, "little") + local.to_bytes(8, "little"), KV_HASH_SEED)
