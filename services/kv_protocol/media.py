"""An image's identity in the mesh, and where its tokens stand in a prompt.

A prompt with images holds, for each image, a run of placeholder tokens (the same id for every
image) that the model's encoder output replaces. Two prompts with the same ids but different
images must never share KV, and two with the same image must: so each image is named by a digest
of its bytes (as vLLM's `mm_hash` names it), and every block that holds any of an image's
placeholders hashes with that digest and the image's offset in the block
(`hashing.local_block_hashes`). Router, workers and KV events then tell images apart with no
field of their own: the local hash of such a block already says which image it holds.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MediaSpan:
    """One image's placeholders: token positions [offset, offset + length) of the prompt."""

    digest: int
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


def media_digest(data: bytes) -> int:
    """An image's identity: the first 8 bytes (little-endian) of BLAKE2b over its bytes. A
    keyed-free cryptographic hash, so no one can craft an image that takes another's cached KV."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


_UUID_PREFIX = "kvmesh-"


def media_uuid(digest: int) -> str:
    """The digest as the identifier an engine keys its encoder cache and blocks by (vLLM's
    `multi_modal_uuids`): its KV events then name the image as the mesh does."""
    return f"{_UUID_PREFIX}{digest:016x}"


def digest_of_uuid(identifier: str) -> int | None:
    """The digest a `media_uuid` holds (an engine may prefix it, vLLM with a LoRA adapter's
    name); None for an identifier the mesh did not give."""
    at = identifier.rfind(_UUID_PREFIX)
    hex_part = identifier[at + len(_UUID_PREFIX):] if at >= 0 else ""
    if len(hex_part) != 16:
        return None
    try:
        return int(hex_part, 16)
    except ValueError:
        return None
