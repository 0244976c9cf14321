"""The cost model of one worker: seconds per engine step, from a few coefficients.

A step runs some prompts (prefill) and advances every running sequence by one token (decode):

    step = [prefill_base + sum over prompts of (n * per_token + n * n / 1000 * quadratic)]
         + [decode_base + seqs * per_seq + context_tokens * per_context_token]

The prefill bracket is charged only when the step has prompts, the decode bracket only when it
has running sequences. The quadratic term is attention over the prompt itself (a prompt of n
tokens costs n * n / 1000 * quadratic on top of its linear cost); the context term is the KV a
decode step reads, the sum of every running sequence's length.

Loading a LoRA adapter stalls the step that loads it (vLLM loads one while it sets up a batch):

    adapter load = adapter_load_base_s + size_bytes / 1e9 * adapter_load_s_per_gb

Both are optional in a profile file; without them a load costs what services/engines/lora.py
expects before it measured one (20 ms + the adapter's bytes at 2 GB/s: a local disk read into
host memory, then a copy to the device).

A vision-language model encodes each image it has not encoded before, in the step that prefills
its prompt, at a cost that grows with the image's patches:

    image = encode_base_s + patches * encode_per_patch_s

Optional too; the defaults are an estimate for a ~600M-parameter ViT (Qwen2-VL's) on an
H100-class GPU: 2 ms plus 15 us a patch (a 1280x720 screenshot, ~4,700 patches of 14 px: 72 ms).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace


# What an adapter load costs when the profile does not say (lora.py's DEFAULT_LOAD_FIXED_S and
# DEFAULT_LOAD_BYTES_PER_S: a unit test keeps the two in step; profiles do not import engines).
ADAPTER_LOAD_BASE_S = 0.02
ADAPTER_LOAD_S_PER_GB = 0.5
# Coefficients a profile file may leave out (older files, profiles measured without adapters).
OPTIONAL_COEFFICIENTS = frozenset({"decode_per_context_token_s", "adapter_load_base_s", "adapter_load_s_per_gb",
                                   "encode_base_s", "encode_per_patch_s"})
ENCODE_BASE_S = 0.002
ENCODE_PER_PATCH_S = 15e-6


class ProfileError(ValueError):
    """A profile that cannot describe a worker; the message is one line."""


@dataclass(frozen=True)
class CostModel:
    prefill_base_s: float
    prefill_per_token_s: float
    prefill_quadratic_s_per_1k: float
    decode_base_s: float
    decode_per_seq_s: float
    decode_per_context_token_s: float = 0.0
    adapter_load_base_s: float = ADAPTER_LOAD_BASE_S
    adapter_load_s_per_gb: float = ADAPTER_LOAD_S_PER_GB
    encode_base_s: float = ENCODE_BASE_S
    encode_per_patch_s: float = ENCODE_PER_PATCH_S

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ProfileError(f"cost model: {f.name} must be a finite number >= 0, got {value!r}")
        if self.decode_base_s <= 0 or self.prefill_per_token_s <= 0:
            raise ProfileError("cost model: prefill_per_token_s and decode_base_s must be > 0")

    def prefill_s(self, tokens: float) -> float:
        """One prompt of `tokens` uncached tokens alone in a step."""
        return self.prefill_base_s + self.prompt_s(tokens)

    def prompt_s(self, tokens: float) -> float:
        """What one prompt adds to a step that already pays the prefill base."""
        return tokens * self.prefill_per_token_s + tokens * (tokens / 1000.0) * self.prefill_quadratic_s_per_1k

    def decode_step_s(self, seqs: int, context_tokens: int) -> float:
        return self.decode_base_s + seqs * self.decode_per_seq_s + context_tokens * self.decode_per_context_token_s

    def step_s(self, prompts: Sequence[int], seqs: int, context_tokens: int) -> float:
        s = 0.0
        if prompts:
            s += self.prefill_base_s + sum(self.prompt_s(n) for n in prompts)
        if seqs:
            s += self.decode_step_s(seqs, context_tokens)
        return s

    def encode_s(self, patches: int) -> float:
        """Encoding one image of `patches` patches."""
        return self.encode_base_s + patches * self.encode_per_patch_s

    def adapter_load_s(self, size_bytes: int) -> float:
        """Loading a LoRA adapter of `size_bytes` (its weight files) onto the device."""
        return self.adapter_load_base_s + size_bytes / 1e9 * self.adapter_load_s_per_gb

    def scaled(self, factor: float) -> CostModel:
        """Every duration times `factor` (a slower or faster machine of the same shape)."""
        if not (math.isfinite(factor) and factor > 0):
            raise ProfileError(f"cost model: a scale must be a finite number > 0, got {factor!r}")
        return replace(self, **{f.name: getattr(self, f.name) * factor for f in fields(self)})

    def to_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: object) -> CostModel:
        if not isinstance(data, dict):
            raise ProfileError("cost model: expected an object of coefficients")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ProfileError(f"cost model: unknown coefficient {unknown[0]!r}")
        missing = sorted(names - set(data) - OPTIONAL_COEFFICIENTS)
        if missing:
            raise ProfileError(f"cost model: missing coefficient {missing[0]!r}")
        return cls(**data)
