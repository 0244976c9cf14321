"""What the planner predicts: TTFT and ITL of a pool size at a given load.

The predictions come from a worker profile (how long a prefill of n tokens takes, how a decode
step grows with the batch), corrected by what the mesh actually shows: the ratio of observed
to predicted latency at the current sizes, smoothed, multiplies every prediction. A profile
that is off by a constant factor (another GPU, another model, queueing the model ignores) is
thereby calibrated away after a few intervals.

- Prefill pool (P workers, each running one prompt at a time): a prompt of I tokens takes
  t = prefill(I); the pool is busy rho = rate * t / P of the time, and a prompt waits behind
  the others as in an M/M/1 queue: TTFT = t / (1 - rho); saturated (rho >= 1) it is unbounded.
- Decode pool (D workers, continuous batching): the pool must produce rate * O tokens/s, so
  each worker x = rate * O / D tokens/s. A step of a batch of n sequences takes a + b * n and
  yields n tokens; in the steady state n = x * step, so step = a / (1 - b * x): the ITL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.engines.mocker.timing import PRESETS, TimingModel
from services.mesh.config_error import ConfigError

# A correction outside this range means the profile describes another system, not a constant
# offset; clamping keeps one odd interval (a burst, a cold cache) from swinging the plan.
CORRECTION_MIN, CORRECTION_MAX = 0.25, 4.0
# Weight of the newest interval in the smoothed correction.
CORRECTION_EMA = 0.5


@dataclass(frozen=True)
class WorkerProfile:
    """Per-worker costs: prefill seconds for a prompt, decode step = base + per_seq * batch."""

    prefill_base_s: float
    prefill_per_token_s: float
    prefill_quadratic_s_per_token_1k: float
    decode_base_s: float
    decode_per_seq_s: float

    def __post_init__(self) -> None:
        if self.decode_base_s <= 0 or self.prefill_per_token_s <= 0:
            raise ConfigError("--profile: prefill per token and decode step base must be > 0")

    @classmethod
    def from_timing(cls, timing: TimingModel) -> WorkerProfile:
        scale = 1.0 / timing.speedup
        return cls(timing.prefill_base_ms / 1e3 * scale, timing.prefill_per_token_us / 1e6 * scale,
                   timing.prefill_quadratic_us_per_1k / 1e6 * scale, timing.decode_base_ms / 1e3 * scale,
                   timing.decode_per_seq_us / 1e6 * scale)

    @classmethod
    def preset(cls, name: str, speedup: float = 1.0) -> WorkerProfile:
        if name not in PRESETS:
            raise ConfigError(f"--profile: unknown profile {name!r} (known: {', '.join(PRESETS)})")
        if not speedup > 0 or math.isinf(speedup):
            raise ConfigError("--speedup must be a positive finite number for the planner's profile")
        return cls.from_timing(TimingModel.preset(name, speedup))

    def prefill_s(self, tokens: float) -> float:
        return self.prefill_base_s + tokens * self.prefill_per_token_s + \
            tokens * (tokens / 1000.0) * self.prefill_quadratic_s_per_token_1k


@dataclass(frozen=True)
class Traffic:
    """What the frontends saw over the last interval."""

    rate_per_s: float
    mean_input_tokens: float
    mean_output_tokens: float
    # Means over the interval, None when nothing was measured (no request finished its first token).
    observed_ttft_s: float | None = None
    observed_itl_s: float | None = None

    @property
    def idle(self) -> bool:
        return self.rate_per_s <= 0


def raw_ttft_s(profile: WorkerProfile, traffic: Traffic, prefill_workers: int) -> float:
    t = profile.prefill_s(traffic.mean_input_tokens)
    if traffic.idle:
        return t
    if prefill_workers <= 0:
        return math.inf
    rho = traffic.rate_per_s * t / prefill_workers
    return math.inf if rho >= 1.0 else t / (1.0 - rho)


def raw_itl_s(profile: WorkerProfile, traffic: Traffic, decode_workers: int) -> float:
    if traffic.idle:
        return profile.decode_base_s
    if decode_workers <= 0:
        return math.inf
    per_worker_tokens_s = traffic.rate_per_s * traffic.mean_output_tokens / decode_workers
    busy = profile.decode_per_seq_s * per_worker_tokens_s
    return math.inf if busy >= 1.0 else profile.decode_base_s / (1.0 - busy)


@dataclass
class Corrections:
    """Observed / predicted latency at the sizes the mesh had, smoothed; 1.0 until measured."""

    ttft: float = 1.0
    itl: float = 1.0

    def update(self, profile: WorkerProfile, traffic: Traffic, prefill_workers: int, decode_workers: int) -> None:
        if traffic.idle:
            return
        if traffic.observed_ttft_s is not None:
            self.ttft = _smoothed(self.ttft, traffic.observed_ttft_s, raw_ttft_s(profile, traffic, prefill_workers))
        if traffic.observed_itl_s is not None:
            self.itl = _smoothed(self.itl, traffic.observed_itl_s, raw_itl_s(profile, traffic, decode_workers))


def _smoothed(previous: float, observed: float, predicted: float) -> float:
    if not math.isfinite(predicted) or predicted <= 0:
        return previous  # a saturated prediction says nothing about the offset
    ratio = min(CORRECTION_MAX, max(CORRECTION_MIN, observed / predicted))
    return (1 - CORRECTION_EMA) * previous + CORRECTION_EMA * ratio
