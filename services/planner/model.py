"""What the planner predicts: TTFT and ITL of a split at a given load, from a worker profile.

The workers' cost model (services/profiles) gives a prefill of n tokens and a decode step of a
batch. Where each prompt is prefilled comes from the decode workers' counters: a share of the
requests goes to the prefill pool (long uncached prompts), the rest is prefilled by the decode
worker that serves it, inside its decode steps.

- Decode pool (D workers, continuous batching). Each worker must produce x = rate * O / D
  tokens/s and run l = local rate / D prompts/s of q seconds each (the prompt's own cost). A
  step of n sequences takes a + b' * n, b' = per_seq + per_context_token * context (prompt +
  half the output), plus the prefill base c when a prompt came during the step before, which
  with Poisson arrivals is 1 - exp(-l * step). Over one second the steps fill the time and
  each yields every sequence one token, so the step, which is the ITL, solves
        ITL = (a + c * (1 - exp(-l * ITL))) / (1 - b' * x - l * q)
  (saturated when b' * x + l * q >= 1); a few rounds of iteration find it.
- A prompt prefilled locally waits for the step under way (half a step on average) and goes
  into the next, which also decodes: TTFT_local = c + q + 1.5 * ITL * u, u = min(1, x * ITL)
  the share of time the worker is decoding at all.
- A prompt prefilled remotely (P workers, each remote rate / P prompts/s, t = prefill(I)):
  one prompt per step, the wait in an M/D/P queue by the Allen-Cunneen approximation,
  Wq = t / 2 * rho^(sqrt(2(P+1)) - 1) / (P(1 - rho)), rho = rate * t / P; but an engine batches
  the prompts waiting, which pay the prefill base once: a step then lasts s = c / (1 - rate * q)
  and a prompt waits half a step and runs in the next, 1.5 * max(s, t). The engine does the
  better of the two. Then the decode worker takes the KV at its next step and emits the first
  token at the end of it: TTFT_remote = prefill wait and run + 1.5 * ITL * u.
- TTFT is the two weighed by their shares.

What the model leaves out (the mesh's hops, the KV transfer, a machine unlike the profile's) is
calibrated by scaling the profile, not the prediction: after each interval the scale of the
decode workers' costs that reproduces the observed ITL is found (predictions grow with it, so
a bisection finds it), then the scale of the prefill pool's that reproduces the observed TTFT,
and both are smoothed (the first measurement is taken as it is). A profile 2x too fast thus
predicts saturation where the mesh really saturates, which scaling the predicted latency
afterwards would not.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from services.contract.worker_roles import RoleName
from services.planner.encode_pool import EncodeTraffic
from services.profiles.cost_model import CostModel

# The scales a bisection may find: a profile 20x off is another system, not a calibration.
SCALE_MIN, SCALE_MAX = 0.05, 20.0
# Weight of the newest interval in the smoothed scales (geometric mean).
SCALE_EMA = 0.5
# Iterations of the decode step's fixed point (it converges geometrically, from below).
FIXED_POINT_ROUNDS = 30
# A TTFT says little about the prefill pool when fewer than this share of prompts went there.
MIN_REMOTE_SHARE_TO_CALIBRATE = 0.2


@dataclass(frozen=True)
class Traffic:
    """What the frontends and decode workers saw over the last interval."""

    rate_per_s: float
    mean_input_tokens: float
    mean_output_tokens: float
    # Means over the interval, None when nothing was measured (no request finished its first token).
    observed_ttft_s: float | None = None
    observed_itl_s: float | None = None
    # Share of requests prefilled on the prefill pool, and the mean uncached prompt tokens of
    # those and of the ones prefilled locally; None when the decode workers were not read.
    remote_share: float | None = None
    remote_prompt_tokens: float | None = None
    local_prompt_tokens: float | None = None
    # The routers' admission queues as last read: requests waiting for a decode worker, and
    # the longest wait a new request is predicted there (0: a worker has room).
    queued: float = 0.0
    queue_wait_s: float = 0.0
    # The images asked of the encode pool (encode_pool.py).
    encode: EncodeTraffic = EncodeTraffic()

    @property
    def idle(self) -> bool:
        return self.rate_per_s <= 0

    def share_remote(self, prefill_workers: int) -> float:
        """Unmeasured, every prompt is taken to go where there is a pool for it."""
        if self.remote_share is not None:
            return self.remote_share
        return 1.0 if prefill_workers > 0 else 0.0

    def remote_tokens(self) -> float:
        return self.remote_prompt_tokens if self.remote_prompt_tokens is not None else self.mean_input_tokens

    def local_tokens(self) -> float:
        return self.local_prompt_tokens if self.local_prompt_tokens is not None else self.mean_input_tokens


@dataclass(frozen=True)
class Prediction:
    ttft_s: float
    itl_s: float


@dataclass(frozen=True)
class Scales:
    """How much slower than the profile each pool turned out: its costs are multiplied by these."""

    decode: float = 1.0
    prefill: float = 1.0


def predict(cost: CostModel, scales: Scales, traffic: Traffic, prefill_workers: int, decode_workers: int) -> Prediction:
    # Without a prefill pool every prompt is prefilled where it is decoded.
    share = traffic.share_remote(prefill_workers) if prefill_workers > 0 else 0.0
    decode_cost = cost.scaled(scales.decode)
    itl, busy_share = _decode(decode_cost, traffic, decode_workers, 1.0 - share)
    ttft = 0.0
    if share < 1.0:
        local_p = decode_cost.prefill_s(traffic.local_tokens())
        ttft += (1.0 - share) * (local_p + 1.5 * itl * busy_share)
    if share > 0.0:
        wait = _remote_prefill_s(cost.scaled(scales.prefill), traffic, share, prefill_workers)
        ttft += share * (wait + 1.5 * itl * busy_share)
    return Prediction(ttft, itl)


def _decode(cost: CostModel, traffic: Traffic, workers: int, local_share: float) -> tuple[float, float]:
    """ITL and the share of time a decode worker is decoding."""
    if traffic.idle:
        return cost.decode_base_s, 0.0
    if workers <= 0:
        return math.inf, 1.0
    tokens_s = traffic.rate_per_s * traffic.mean_output_tokens / workers
    local_s = traffic.rate_per_s * local_share / workers
    context = traffic.mean_input_tokens + traffic.mean_output_tokens / 2
    per_seq = cost.decode_per_seq_s + cost.decode_per_context_token_s * context
    busy = per_seq * tokens_s + local_s * cost.prompt_s(traffic.local_tokens())
    if busy >= 1.0:
        return math.inf, 1.0
    # The prompts that arrive during a step share the next step's prefill base: a step pays it
    # when at least one came (Poisson arrivals), which depends on the step's own length.
    itl = cost.decode_base_s / (1.0 - busy)
    for _ in range(FIXED_POINT_ROUNDS):
        itl = (cost.decode_base_s + cost.prefill_base_s * -math.expm1(-local_s * itl)) / (1.0 - busy)
    return itl, min(1.0, tokens_s * itl)


def _remote_prefill_s(cost: CostModel, traffic: Traffic, share: float, workers: int) -> float:
    """Queueing plus prefill on the prefill pool."""
    t = cost.prefill_s(traffic.remote_tokens())
    if traffic.idle:
        return t
    if workers <= 0:
        return math.inf
    per_worker = traffic.rate_per_s * share / workers
    rho = per_worker * t
    queued = math.inf
    if rho < 1.0:
        queued = t + t / 2 * rho ** (math.sqrt(2 * (workers + 1)) - 1) / (workers * (1 - rho))
    # Batched: the prompts that came during a step run together in the next, paying the base
    # once, so a step lasts base / (1 - rate * q) and a prompt waits half of one, then its own.
    work = per_worker * cost.prompt_s(traffic.remote_tokens())
    batched = math.inf if work >= 1.0 else 1.5 * max(t, cost.prefill_base_s / (1.0 - work))
    return min(queued, batched)


@dataclass
class Calibration:
    """The smoothed scales, updated from each interval's observations at the sizes it had. A
    pool's first measured scale is taken as it is: the 1.0 before it is the profile's claim, not
    a measurement to average with, and half-way there a planner would pick a split it has to
    undo one cool-down later."""

    scales: Scales = field(default_factory=Scales)
    measured: set[RoleName] = field(default_factory=set)

    def update(self, cost: CostModel, traffic: Traffic, prefill_workers: int, decode_workers: int) -> None:
        if traffic.idle:
            return
        decode, prefill = self.scales.decode, self.scales.prefill
        now = predict(cost, self.scales, traffic, prefill_workers, decode_workers)
        # A pool the model calls saturated shows the latency of the requests that got through,
        # which says nothing about its scale: such an interval leaves the scale as it was.
        if traffic.observed_itl_s is not None and decode_workers > 0 and math.isfinite(now.itl_s):
            found = _solve(lambda k: predict(cost, Scales(k, prefill), traffic, prefill_workers,
                                              decode_workers).itl_s, traffic.observed_itl_s)
            decode = self._blend(RoleName.DECODE, decode, found)
        remote = traffic.share_remote(prefill_workers)
        if (traffic.observed_ttft_s is not None and prefill_workers > 0 and remote >= MIN_REMOTE_SHARE_TO_CALIBRATE
                and math.isfinite(now.ttft_s)):
            found = _solve(lambda k: predict(cost, Scales(decode, k), traffic, prefill_workers,
                                              decode_workers).ttft_s, traffic.observed_ttft_s)
            prefill = self._blend(RoleName.PREFILL, prefill, found)
        self.scales = Scales(decode, prefill)

    def _blend(self, pool: RoleName, previous: float, found: float) -> float:
        # A first scale at the edge of the range is an interval the model cannot explain, not a
        # measurement to adopt whole.
        if pool not in self.measured and SCALE_MIN < found < SCALE_MAX:
            self.measured.add(pool)
            return found
        return _smoothed(previous, found)


def _solve(predicted: Callable[[float], float], observed: float) -> float:
    """The scale in [SCALE_MIN, SCALE_MAX] whose prediction meets `observed` (predictions grow
    with the scale; past saturation they are infinite), by bisection on its logarithm."""
    low, high = math.log(SCALE_MIN), math.log(SCALE_MAX)
    if predicted(SCALE_MIN) >= observed:
        return SCALE_MIN
    if predicted(SCALE_MAX) <= observed:
        return SCALE_MAX
    for _ in range(40):
        mid = (low + high) / 2
        if predicted(math.exp(mid)) < observed:
            low = mid
        else:
            high = mid
    return math.exp((low + high) / 2)


def _smoothed(previous: float, found: float) -> float:
    return math.exp((1 - SCALE_EMA) * math.log(previous) + SCALE_EMA * math.log(found))
