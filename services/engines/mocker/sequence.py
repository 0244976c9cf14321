"""One request inside the mocker engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.engines.base import EngineRequest, FinishReason
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

    def answer_ends(self, position: int, answer_tokens: int) -> bool:
        """Whether the token at `position` of the output ends the answer (--answer-tokens): an
        end-of-sequence the request does not ignore, past its min_tokens. Counted in output
        positions, so a request moved to another worker ends where it would have."""
        sampling = self.request.sampling
        return answer_tokens > 0 and not sampling.ignore_eos and position + 1 >= max(answer_tokens, sampling.min_tokens)

    def finish_reason(self, token: int) -> FinishReason | None:
        """Why the sequence ends after `token`, its latest (None: it goes on)."""
        sampling = self.request.sampling
        if self.generated >= sampling.max_tokens:
            return FinishReason.LENGTH
        if token in sampling.stop_token_ids and self.generated >= sampling.min_tokens:
            return FinishReason.STOP
        return None
