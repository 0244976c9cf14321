"""How long the mocker's engine steps take.

Defaults approximate an 8B-parameter model on one H100-class GPU (bf16): prefill around
16k tokens/s with a mild quadratic attention term, and a decode step of ~12 ms that grows
by ~0.08 ms per sequence in the batch. `speedup` divides every duration; `inf` makes steps free.
PRESETS name other machines (`--timing NAME`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class TimingModel:
    prefill_base_ms: float = 5.0
    prefill_per_token_us: float = 60.0
    # Attention cost of a long prompt grows with its square; per token of prompt, per 1k tokens.
    prefill_quadratic_us_per_1k: float = 4.0
    decode_base_ms: float = 12.0
    decode_per_seq_us: float = 80.0
    speedup: float = 1.0

    @classmethod
    def preset(cls, name: str, speedup: float = 1.0) -> TimingModel:
        return replace(PRESETS[name], speedup=speedup)

    def step_seconds(self, prefill_tokens: int, decode_seqs: int) -> float:
        if self.speedup == float("inf") or (prefill_tokens == 0 and decode_seqs == 0):
            return 0.0
        ms = 0.0
        if prefill_tokens:
            ms += self.prefill_base_ms + prefill_tokens * self.prefill_per_token_us / 1000.0
            ms += prefill_tokens * (prefill_tokens / 1000.0) * self.prefill_quadratic_us_per_1k / 1000.0
        if decode_seqs:
            ms += self.decode_base_ms + decode_seqs * self.decode_per_seq_us / 1000.0
        return ms / 1000.0 / self.speedup

    def load_seconds(self, nbytes: int, gbps: float) -> float:
        """Moving `nbytes` of KV over a `gbps` GB/s link (a host-tier load-back)."""
        if self.speedup == float("inf") or nbytes <= 0:
            return 0.0
        return nbytes / (gbps * 1e9) / self.speedup

    def prefill_us_per_token_per_1k(self) -> float:
        """The growth of one prompt token's cost per 1k tokens before it: the derivative of the
        quadratic term, whose integral over a prompt of n tokens is n * n / 1000 * the term."""
        return 2.0 * self.prefill_quadratic_us_per_1k


DEFAULT_PRESET = "h100-8b"
PRESETS: dict[str, TimingModel] = {
    # The defaults above.
    DEFAULT_PRESET: TimingModel(),
    # A larger accelerator (B200/GB200 class) serving the same 8B model: ~2.5x the prefill rate,
    # an 8 ms decode step. An 8k-token prompt prefills in ~250 ms.
    "large-gpu-8b": TimingModel(prefill_base_ms=5.0, prefill_per_token_us=20.0, prefill_quadratic_us_per_1k=1.2,
                                decode_base_ms=8.0, decode_per_seq_us=50.0),
    # A fixed 20 ms decode step whatever the batch, and near-free prefill: for measuring what the
    # mesh adds to the time between tokens under many concurrent streams.
    "fixed-step-20ms": TimingModel(prefill_base_ms=0.5, prefill_per_token_us=1.0, prefill_quadratic_us_per_1k=0.0,
                                   decode_base_ms=20.0, decode_per_seq_us=0.0),
}
