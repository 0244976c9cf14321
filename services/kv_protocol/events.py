"""What an engine says when its KV cache changes: blocks stored (in a tier, under a parent),
blocks removed from a tier, or everything cleared. Workers number and forward these; the
router's index applies them."""

from __future__ import annotations

from dataclasses import dataclass

from services.kv_protocol.hashing import LocalBlockHash, SequenceHash
from services.kv_protocol.tier import Tier


@dataclass(frozen=True, slots=True)
class KvStored:
    parent_hash: SequenceHash | None
    # (engine block hash, local tokens hash) per block, parent first.
    blocks: tuple[tuple[SequenceHash, LocalBlockHash], ...]
    # The tier that now holds them; the parent may be in either.
    tier: Tier = Tier.DEVICE
    # The LoRA adapter that computed them ("" for the base model); their local hashes are seeded
    # with it already, so the index needs nothing else to keep adapters apart.
    lora_name: str = ""


@dataclass(frozen=True, slots=True)
class KvRemoved:
    block_hashes: tuple[SequenceHash, ...]
    tier: Tier = Tier.DEVICE


@dataclass(frozen=True, slots=True)
class KvCleared:
    pass


KvEventData = KvStored | KvRemoved | KvCleared
