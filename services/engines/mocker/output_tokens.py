"""The mocker's output tokens: a hash, not a sample.

The token at each position of a request's output is a hash of the original prompt, the sampling
parameters, the LoRA adapter and the position, so every worker produces the same continuation:
a request moved mid-stream goes on exactly, and a disaggregated request's output equals the
aggregated one. Each adapter's output differs from the base model's and every other adapter's,
as a fine-tune's would, and the base model's is what it was before adapters existed.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from services.engines.base import EngineRequest
from services.kv_protocol.hashing import adapter_seed, block_bytes


@dataclass(frozen=True, slots=True)
class OutputTokens:
    """Token ids drawn from a vocabulary, skipping its lowest ids, where byte-level tokenizers
    keep special tokens."""

    low: int
    span: int

    @classmethod
    def of_vocab(cls, vocab_size: int) -> OutputTokens:
        low = min(8, vocab_size - 1)
        return cls(low, max(1, vocab_size - low))

    @staticmethod
    def digest(request: EngineRequest) -> int:
        """What every token of the request's output depends on, besides its position: the
        original prompt (without output resumed from another worker) and its images (their
        digests), the sampling and the LoRA adapter (its `adapter_seed`)."""
        s = request.sampling
        params = f"{s.seed}|{s.temperature}|{s.top_p}|{s.top_k}"
        if request.lora_name:
            params += f"|lora:{adapter_seed(request.lora_name)}"
        for item in request.media:
            params += f"|image:{item.span.digest}@{item.span.offset}"
        prompt = request.token_ids[: len(request.token_ids) - request.resumed_tokens]
        return xxhash.xxh3_64_intdigest(block_bytes(prompt) + params.encode())

    def at(self, digest: int, position: int) -> int:
        """The token at `position` of the output, counting output resumed from another worker."""
        return self.low + xxhash.xxh3_64_intdigest(position.to_bytes(8, "little"), digest) % self.span
