"""The planner's decision: how many workers each pool needs at the observed load.

Two modes:
- **sized pools** (no `--total-workers`): each pool gets the fewest workers whose predicted
  latency (model.py, calibrated) meets its SLO, within its minimum and maximum: the decode
  pool by ITL, then the prefill pool by TTFT at that decode size (a TTFT that no prefill pool
  size changes, every prompt being prefilled locally, keeps the pool at its floor). A pool grows as
  soon as it falls short, but shrinks only when the smaller size would still meet the SLO with
  `headroom` to spare: between the two sizes the current one stays (hysteresis), so a load at
  the edge does not flap a worker in and out. Requests waiting in the routers' admission queues
  mean every decode slot is taken: the decode pool then grows by one, whatever the model says.
- **a fixed budget** (`--total-workers N`: N GPUs, roles switched, nothing started): every split
  of N is scored by its worse SLO ratio (predicted / SLO of TTFT and of ITL) and the best is
  chosen, but only when it beats the current split's score by `switch_gain`.

Either way a pool changed less than `cooldown_s` ago keeps its size (its workers are still
warming up, and the latency it shows is still that of the old size), and a pool never drops
below one worker while there is traffic. The encode pool (E/P/D, with `--max-encode-workers`)
is sized on its own, by starting and stopping its workers (encode_pool.py), in either mode.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from services.config_error import ConfigError
from services.profiles.cost_model import CostModel
from services.planner.model import Calibration, Prediction, Traffic, predict
from services.contract.worker_roles import RoleName
from services.planner.encode_pool import WAIT_SHARE_OF_TTFT, EncodeLimits, encode_pool_size
from services.planner.pools import ROLES, SIZED_ROLES, PoolSizes


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    itl_s: float

    def __post_init__(self) -> None:
        if not self.ttft_s > 0:
            raise ConfigError("--ttft-slo-ms must be > 0")
        if not self.itl_s > 0:
            raise ConfigError("--itl-slo-ms must be > 0")


@dataclass(frozen=True)
class Limits:
    min_prefill: int = 1
    max_prefill: int = 8
    min_decode: int = 1
    max_decode: int = 8
    # Workers in all (a fixed GPU budget: the plan switches roles, never starts or stops).
    total: int | None = None
    cooldown_s: float = 30.0
    # A pool shrinks only if the smaller size predicts <= headroom x SLO.
    headroom: float = 0.7
    # A fixed budget is re-split only if the new split's score is below switch_gain x the current one's.
    switch_gain: float = 0.8
    encode: EncodeLimits = field(default_factory=EncodeLimits)

    def __post_init__(self) -> None:
        if not 0 <= self.min_prefill <= self.max_prefill:
            raise ConfigError("--min-prefill-workers must be >= 0 and <= --max-prefill-workers")
        if not 1 <= self.min_decode <= self.max_decode:
            raise ConfigError("--min-decode-workers must be >= 1 and <= --max-decode-workers")
        if self.total is not None and not self.min_prefill + self.min_decode <= self.total:
            raise ConfigError("--total-workers must be at least --min-prefill-workers + --min-decode-workers")
        if self.cooldown_s < 0:
            raise ConfigError("--cooldown must be >= 0")
        if not 0 < self.headroom <= 1:
            raise ConfigError("--scale-down-headroom must be in (0, 1]")
        if not 0 < self.switch_gain <= 1:
            raise ConfigError("--switch-gain must be in (0, 1]")


@dataclass(frozen=True)
class Decision:
    desired: PoolSizes
    predicted_ttft_s: float
    predicted_itl_s: float
    # Why the plan is what it is, one phrase, for the log line.
    reason: str
    # What the model said of the interval just measured, at the sizes it was measured at and
    # before this interval's calibration: set against what was observed, the model's error.
    hindsight: Prediction | None = None

    @property
    def score(self) -> float:
        return max(self.predicted_ttft_s, self.predicted_itl_s)


class Policy:
    """Decides every interval; remembers when each pool last changed and the calibration."""

    def __init__(self, cost: CostModel, slo: Slo, limits: Limits) -> None:
        self.cost, self.slo, self.limits = cost, slo, limits
        self.calibration = Calibration()
        self._changed_at = {role: -math.inf for role in SIZED_ROLES}

    def predict(self, traffic: Traffic, sizes: PoolSizes) -> Prediction:
        return predict(self.cost, self.calibration.scales, traffic, sizes.prefill, sizes.decode)

    def decide(self, now: float, current: PoolSizes, traffic: Traffic, measured: PoolSizes | None = None) -> Decision:
        """Plans from `current`; `measured` are the sizes the traffic was measured at, when they
        differ (a dry run plans from the sizes it would have set)."""
        sized = measured or current
        hindsight = None if traffic.idle else self.predict(traffic, sized)
        self.calibration.update(self.cost, traffic, sized.prefill, sized.decode)
        if self.limits.total is None:
            desired, reason = self._sized(current, traffic)
        else:
            desired, reason = self._split(current, traffic, self.limits.total)
        desired, reason = self._encode_pool(current, replace(desired, encode=current.encode), traffic, reason)
        desired, held = self._cool_down(now, current, desired)
        if held:
            reason = f"{reason}; {held} cooling down"
        for role in SIZED_ROLES:
            if desired.of(role) != current.of(role):
                self._changed_at[role] = now
        planned = self.predict(traffic, desired)
        return Decision(desired, planned.ttft_s, planned.itl_s, reason, hindsight)

    # -- sized pools ---------------------------------------------------------------------------

    def _sized(self, current: PoolSizes, traffic: Traffic) -> tuple[PoolSizes, str]:
        lim = self.limits
        decode = self._size(current.decode, lim.min_decode, lim.max_decode, traffic,
                            lambda n: self.predict(traffic, PoolSizes(current.prefill, n)).itl_s / self.slo.itl_s)
        queue_grew = traffic.queued > 0 and decode <= current.decode
        if queue_grew:
            # Requests wait in the routers' queues: every decode slot is taken, whatever the
            # model says of the ITL, so the pool grows (and never shrinks while they wait).
            decode = min(lim.max_decode, current.decode + 1)
        prefill = self._size(current.prefill, lim.min_prefill, lim.max_prefill, traffic,
                             lambda n: self.predict(traffic, PoolSizes(n, decode)).ttft_s / self.slo.ttft_s)
        desired = PoolSizes(prefill, decode, current.encode)  # the encode pool is sized after (_encode_pool)
        if queue_grew:
            return desired, f"{traffic.queued:.0f} requests wait in the routers' queues"
        return desired, "sizes meet the SLOs" if desired == current else "resized to meet the SLOs"

    def _size(self, current: int, low: int, high: int, traffic: Traffic, ratio: Callable[[int], float]) -> int:
        floor = max(low, 0 if traffic.idle else 1)
        if ratio(floor) == ratio(high) and math.isfinite(ratio(high)):
            return floor  # the pool's size changes nothing predicted: the fewest it may have
        needed = next((n for n in range(floor, high + 1) if ratio(n) <= 1.0), high)
        if current < needed:
            return needed
        # Predictions fall as a pool grows, so relaxed >= needed.
        relaxed = next((n for n in range(floor, high + 1) if ratio(n) <= self.limits.headroom), high)
        return relaxed if current > relaxed else min(current, high)

    # -- the encode pool -----------------------------------------------------------------------

    def _encode_pool(self, current: PoolSizes, desired: PoolSizes, traffic: Traffic,
                     reason: str) -> tuple[PoolSizes, str]:
        if not self.limits.encode.sized:
            return desired, reason
        n, why = encode_pool_size(current.encode, traffic.encode, self.limits.encode,
                                  WAIT_SHARE_OF_TTFT * self.slo.ttft_s, self.limits.headroom)
        if n == current.encode:
            return desired, reason
        return desired.with_role(RoleName.ENCODE, n), f"{reason}; encode pool {current.encode} -> {n}: {why}"

    # -- a fixed budget ------------------------------------------------------------------------

    def _split(self, current: PoolSizes, traffic: Traffic, total: int) -> tuple[PoolSizes, str]:
        if traffic.idle:
            return current, "no traffic"
        lim = self.limits
        candidates = [PoolSizes(p, total - p) for p in range(lim.min_prefill, total - lim.min_decode + 1)
                      if p <= lim.max_prefill and total - p <= lim.max_decode]
        if not candidates:
            return current, "no split fits the limits"
        best = min(candidates, key=lambda s: (self._score(traffic, s), abs(s.prefill - current.prefill)))
        now_score = self._score(traffic, current) if current.total == total else math.inf
        if best == current or self._score(traffic, best) >= lim.switch_gain * now_score:
            return current, "current split is within the switch margin of the best"
        return best, f"split scores {self._score(traffic, best):.2f} against {now_score:.2f} now"

    def _score(self, traffic: Traffic, sizes: PoolSizes) -> float:
        predicted = self.predict(traffic, sizes)
        return max(predicted.ttft_s / self.slo.ttft_s, predicted.itl_s / self.slo.itl_s)

    # -- cool-down -----------------------------------------------------------------------------

    def _cool_down(self, now: float, current: PoolSizes, desired: PoolSizes) -> tuple[PoolSizes, str]:
        cooling = [r for r in SIZED_ROLES
                   if desired.of(r) != current.of(r) and now - self._changed_at[r] < self.limits.cooldown_s]
        if not cooling:
            return desired, ""
        if self.limits.total is not None and any(r in ROLES for r in cooling):
            # A switch moves both pools or neither.
            desired = replace(desired, prefill=current.prefill, decode=current.decode)
        for role in cooling:
            desired = desired.with_role(role, current.of(role))
        return desired, " and ".join(cooling)
