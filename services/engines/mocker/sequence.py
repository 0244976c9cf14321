"""One request inside the mocker engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.engines.base import EngineRequest
from services.engines.output_channel import OutputChannel
from services.kv_protocol.hashing import KV_HASH_SEED, LocalBlockHash, SequenceHash


@dataclass(eq=False, slots=True)
class Seq:
    """A request as the engine schedules it: its tokens so far, its blocks and their hashes."""

    request: EngineRequest
    tokens: list[int]
    prompt_len: int
    digest: int
    out: OutputChannel
    # Seeds the local hashes of its blocks: `adapter_seed` of its LoRA adapter.
    hash_seed: int = KV_HASH_SEED
    blocks: list[int] = field(default_factory=list)
    # Chained hashes of the full blocks of `tokens`, grown as decode fills blocks.
    chain: list[SequenceHash] = field(default_factory=list)
    locals_: list[LocalBlockHash] = field(default_factory=list)
    cached_tokens: int = 0
    generated: int = 0
    done: bool = False
    # The prompt's KV came from a prefill worker: admitting it costs no prefill compute.
    remote_kv: bool = False
    # When the host blocks prefetched for it are on the device (engine clock; 0: none moved).
    kv_ready_at: float = 0.0
