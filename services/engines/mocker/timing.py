"""How long the mocker's engine steps take: a worker profile's cost model, run as a clock.

The model is a profile (services/profiles): a preset by name (`--timing h100-8b`, the default:
an 8B model on one H100-class GPU) or a file `python -m services.planner profile` measured
(`--timing-profile FILE`), so the mocker can imitate a worker that was really measured and a
benchmark can give it a different profile than the planner's. `speedup` divides every
duration; `inf` makes steps free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from services.profiles.cost_model import CostModel
from services.profiles.profile_file import DEFAULT_PRESET, load_profile


def _default_cost() -> CostModel:
    return load_profile(DEFAULT_PRESET).cost


@dataclass(frozen=True)
class TimingModel:
    cost: CostModel = field(default_factory=_default_cost)
    speedup: float = 1.0

    @classmethod
    def of_profile(cls, name_or_path: str, speedup: float = 1.0) -> TimingModel:
        return cls(load_profile(name_or_path).cost, speedup)

    def step_seconds(self, prompts: Sequence[int], decode_seqs: int, context_tokens: int = 0) -> float:
        """A step that prefills `prompts` (uncached tokens of each) and decodes `decode_seqs`
        sequences holding `context_tokens` tokens in all."""
        if self.speedup == float("inf"):
            return 0.0
        return self.cost.step_s(prompts, decode_seqs, context_tokens) / self.speedup

    def load_seconds(self, nbytes: int, gbps: float) -> float:
        """Moving `nbytes` of KV over a `gbps` GB/s link (a host-tier load-back)."""
        if self.speedup == float("inf") or nbytes <= 0:
            return 0.0
        return nbytes / (gbps * 1e9) / self.speedup

    def encode_seconds(self, patches: Sequence[int]) -> float:
        """Encoding images of these patches in one step (their prompts' step waits for them)."""
        if self.speedup == float("inf") or not patches:
            return 0.0
        return sum(self.cost.encode_s(n) for n in patches) / self.speedup

    def adapter_load_seconds(self, size_bytes: int) -> float:
        """Loading a LoRA adapter of `size_bytes` (the profile's adapter-load terms), during which
        the engine's step stalls."""
        if self.speedup == float("inf"):
            return 0.0
        return self.cost.adapter_load_s(size_bytes) / self.speedup

    @property
    def prefill_per_token_us(self) -> float:
        return self.cost.prefill_per_token_s * 1e6

    def prefill_us_per_token_per_1k(self) -> float:
        """The growth of one prompt token's cost per 1k tokens before it: the derivative of the
        quadratic term, whose integral over a prompt of n tokens is n * n / 1000 * the term."""
        return 2.0 * self.cost.prefill_quadratic_s_per_1k * 1e6
