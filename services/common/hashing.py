"""Block hashing shared with NVIDIA Dynamo: xxh3_64(seed=1337) over little-endian u32 token ids."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import xxhash

KV_HASH_SEED = 1337
_NEEDS_BYTESWAP = sys.byteorder != "little"


def block_bytes(tokens: Sequence[int]) -> bytes:
    buf = array("I", tokens)
    if _NEEDS_BYTESWAP:
        buf.byteswap()
    return buf.tobytes()


def local_block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """The local hash of every full block of `tokens`; a trailing partial block is not hashed."""
    full = len(tokens) - len(tokens) % block_size
    if full == 0:
        return []
    data = block_bytes(tokens[:full])
    step = block_size * 4
    h = xxhash.xxh3_64_intdigest
    return [h(data[i : i + step], KV_HASH_SEED) for i in range(0, len(data), step)]


def chained_block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Hashes that identify a block *and* everything before it, as engines key their caches."""
    return chain_from(local_block_hashes(tokens, block_size))


def chain_from(local_hashes: Sequence[int], parent: int = 0) -> list[int]:
    """The chained hashes of blocks with these local hashes, following the block hashed `parent`."""
    out: list[int] = []
    for local in local_hashes:
        parent = chain_hash(parent, local)
        out.append(parent)
    return out


def chain_hash(parent: int, local: int) -> int:
    """The hash of a block given its parent's chained hash (0 for the first block)."""
    return xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + local.to_bytes(8, "little"), KV_HASH_SEED)
