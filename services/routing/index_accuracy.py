"""How right the router's index is, per worker: what it predicted a worker caches of each prompt
routed there, against what the worker's engine then found.

The rule, per routed request (one sample):

    predicted = reusable_tokens(device overlap + host-only overlap blocks, block_size, prompt, engine)
    found     = the engine's cached_tokens, reported back by the processor (router.proto RouteFeedback)
    ratio     = min(predicted, found) / max(predicted, found)        (1.0 when both are 0)
    error     = |predicted - found| tokens

`predicted` is what the engine could have reused as the router saw it: every matched block, host
ones included (an engine loads those back instead of recomputing them), capped as the engine
caps. vLLM must compute the prompt's last token to get its logits, so it never reuses it: a
fully cached prompt of k blocks reports (k - 1) * block_size. The mocker reuses every full block
it holds and reports min(blocks * block_size, prompt). `ENGINES_RECOMPUTING_LAST_TOKEN` names
the engines of the first kind; any other engine is taken at its blocks.

A worker's recent accuracy is the mean ratio over its last `RECENT_SAMPLES` samples. What other
routing code reads (the fallback that switches a worker whose accuracy falls under a threshold
to predicting its cache from the prompts sent to it):

- `IndexAccuracy.recent(worker_id) -> float | None`: that mean, 0..1; None before any sample;
- `IndexAccuracy.samples(worker_id) -> tuple[Sample, ...]`: the samples it averages, oldest
  first (`len` of it says how settled the mean is);
- `IndexAccuracy.forget(worker_id)`: the worker left its pool (the router calls it).

`RecentPredictions` is where the router keeps each decision's prediction until its feedback
comes, so the feedback carries none. Bounded: at most `MAX_PREDICTIONS` entries, none older than
`PREDICTION_TTL_S` (the oldest go first); a request that never reports back (it failed before
its first output, or went to a pool whose worker reports nothing) is dropped with them.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

# Samples the recent accuracy averages, per worker: enough that one odd request moves it by
# 1/32 at most, few enough that a worker whose events stopped shows within a few dozen requests.
RECENT_SAMPLES = 32
# Predictions waiting for their feedback: about a minute of routing at 1000 requests/s.
MAX_PREDICTIONS = 65536
# A request reports at its first output, however long it queued on its worker first.
PREDICTION_TTL_S = 300.0
# Engines that never reuse a prompt's last token from their cache (see the module docstring).
ENGINES_RECOMPUTING_LAST_TOKEN = frozenset({"vllm"})


def reusable_tokens(blocks: int, block_size: int, prompt_tokens: int, engine: str) -> int:
    """The prompt tokens an engine can reuse when it caches the prompt's first `blocks` blocks."""
    if engine in ENGINES_RECOMPUTING_LAST_TOKEN:
        # Whole blocks only, and never the last token: the block that holds it is recomputed.
        return min(blocks, max(0, prompt_tokens - 1) // block_size) * block_size
    return min(blocks * block_size, prompt_tokens)


@dataclass(frozen=True, slots=True)
class Sample:
    """One routed request: the tokens the router predicted the engine would reuse, and those it did."""

    predicted_tokens: int
    cached_tokens: int

    @property
    def ratio(self) -> float:
        high = max(self.predicted_tokens, self.cached_tokens)
        return min(self.predicted_tokens, self.cached_tokens) / high if high else 1.0

    @property
    def error_tokens(self) -> int:
        return abs(self.predicted_tokens - self.cached_tokens)


class _Recent:
    """One worker's last samples and the sum of their ratios (a mean in O(1))."""

    __slots__ = ("samples", "total")

    def __init__(self, window: int) -> None:
        self.samples: deque[Sample] = deque(maxlen=window)
        self.total = 0.0

    def add(self, sample: Sample) -> None:
        samples = self.samples
        if len(samples) == samples.maxlen:
            self.total -= samples[0].ratio
        samples.append(sample)
        self.total += sample.ratio

    def mean(self) -> float:
        # Clamped: a sum kept by adding and subtracting drifts by a few ulps.
        return min(1.0, max(0.0, self.total / len(self.samples)))


class IndexAccuracy:
    """Per worker, its last `window` samples and their mean ratio (the module's API)."""

    def __init__(self, window: int = RECENT_SAMPLES) -> None:
        if window < 1:
            raise ValueError(f"the recent accuracy needs a window of at least 1 sample, got {window}")
        self._window = window
        self._workers: dict[str, _Recent] = {}

    def observe(self, worker_id: str, predicted_tokens: int, cached_tokens: int) -> Sample:
        sample = Sample(predicted_tokens, cached_tokens)
        recent = self._workers.get(worker_id)
        if recent is None:
            recent = self._workers[worker_id] = _Recent(self._window)
        recent.add(sample)
        return sample

    def recent(self, worker_id: str) -> float | None:
        """The worker's mean ratio over its last samples; None before its first."""
        recent = self._workers.get(worker_id)
        return recent.mean() if recent is not None else None

    def samples(self, worker_id: str) -> tuple[Sample, ...]:
        """The samples `recent` averages, oldest first (at most the window)."""
        recent = self._workers.get(worker_id)
        return tuple(recent.samples) if recent is not None else ()

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)


@dataclass(frozen=True, slots=True)
class Prediction:
    predicted_tokens: int
    prompt_tokens: int
    at: float
    # Whether the worker's KV events made the prediction (else the prompts routed to it did:
    # kv_source.py); only those samples say how right its index is.
    from_events: bool = True
    # While it was predicted for an index found wrong: what its index alone said (None when not
    # asked), which the feedback then judges (kv_source.py's agreement).
    index_tokens: int | None = None


class RecentPredictions:
    """Each decision's prediction, by (request id, worker id), until its feedback takes it
    (bounds in the module docstring)."""

    def __init__(self, max_entries: int = MAX_PREDICTIONS, ttl_s: float = PREDICTION_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._max = max_entries
        self._ttl_s = ttl_s
        self._clock = clock
        # Insertion order is age order: the oldest entry is the first. An OrderedDict, not a dict:
        # popping a dict's first entry again and again leaves deleted slots at its front, which
        # every later look for the first entry walks past.
        self._entries: OrderedDict[tuple[str, str], Prediction] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def remember(self, request_id: str, worker_id: str, predicted_tokens: int, prompt_tokens: int,
                 from_events: bool = True, index_tokens: int | None = None) -> None:
        now = self._clock()
        entries = self._entries
        key = (request_id, worker_id)
        entries.pop(key, None)  # routed there again: the newer prediction, at the back
        entries[key] = Prediction(predicted_tokens, prompt_tokens, now, from_events, index_tokens)
        horizon = now - self._ttl_s
        while entries:
            oldest = next(iter(entries.values()))
            if len(entries) <= self._max and oldest.at >= horizon:
                break
            entries.popitem(last=False)

    def take(self, request_id: str, worker_id: str) -> Prediction | None:
        """The prediction for the request on that worker, once: None if unknown, taken or expired."""
        prediction = self._entries.pop((request_id, worker_id), None)
        if prediction is None or prediction.at < self._clock() - self._ttl_s:
            return None
        return prediction
