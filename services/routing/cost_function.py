"""The KV-aware cost function: prefer cached prefixes, avoid full caches and long queues.

The seed rule (`--cost-model seed`, the default; NVIDIA Dynamo's KV router's older one, before its
block-count cost, which dynamo_cost.py implements for `--cost-model dynamo`), per candidate worker:

    logit = 2 * overlap_ratio - gpu_cache_usage - normalized_waiting

where overlap_ratio is the share of the prompt's tokens the worker already caches and
normalized_waiting its queue length over the longest queue among the candidates. A block the
worker holds in host memory only counts as `host_credit` of a cached block (`host_credit.py`:
what loading it back saves against recomputing it). The best
logit wins; among equal logits the worker caching the fewest blocks (so new prefixes spread over
the pool's cache), then chance. With a temperature > 0 the choice is sampled from softmax(logit / T).

Beyond that rule: its load inputs lag behind by up to one metrics period, so a burst of
requests sharing a prefix would all see the same idle worker. The router therefore adds the
requests and blocks it dispatched itself since the worker's last report (`pending_*`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from services.mesh.config_error import ConfigError


class CostModel(StrEnum):
    """The rule a `kv` router scores workers with (`--cost-model`)."""

    # This module's: cached share against cache usage and queue.
    SEED = "seed"
    # NVIDIA Dynamo's: blocks to prefill plus blocks to decode (dynamo_cost.py).
    DYNAMO = "dynamo"


# The flag's choices, as written on a command line.
COST_MODELS = tuple(m.value for m in CostModel)


@dataclass(frozen=True)
class CostWeights:
    """The `kv` picker's settings: which rule scores the workers, and the rules' weights; each
    setting that cannot work is a ConfigError naming its flag when built."""

    overlap: float = 2.0
    cache_usage: float = 1.0
    waiting: float = 1.0
    temperature: float = 0.0
    # A fixed credit for every host-held block instead of the derived one (None: derived).
    host_overlap: float | None = None
    # Carried here, not beside it in RouterConfig, because the picker is built from these
    # settings alone.
    model: CostModel = CostModel.SEED
    # The Dynamo rule's weight of prefill blocks against decode blocks (its other parameters keep
    # Dynamo's defaults: dynamo_cost.DynamoCostConfig); the seed rule ignores it.
    prefill_load_scale: float = 1.0

    def __post_init__(self) -> None:
        # The flag's string is converted where it is parsed (flags.py); a bare string is not a model.
        if not isinstance(self.model, CostModel):
            raise ConfigError(f"--cost-model {self.model!r} is not one of {', '.join(COST_MODELS)}")
        if not (math.isfinite(self.prefill_load_scale) and self.prefill_load_scale >= 0):
            raise ConfigError(f"--prefill-load-scale must be finite and >= 0, got {self.prefill_load_scale}")


@dataclass(frozen=True, slots=True)
class Candidate:
    worker_id: str
    overlap_blocks: int
    kv_active_blocks: int
    kv_total_blocks: int
    num_requests_waiting: int
    gpu_cache_usage_perc: float
    pending_requests: int = 0
    pending_blocks: int = 0
    # Requests the worker reported running (the Dynamo rule's estimate of a waiting one's blocks).
    num_requests_running: int = 0
    # Blocks the router's index holds for this worker: the tie-breaker.
    indexed_blocks: int = 0
    # Prompt blocks after the device-held prefix that the worker holds in host memory, and what
    # each is worth against a device block.
    host_overlap_blocks: int = 0
    host_credit: float = 0.0

    def cached_blocks(self) -> float:
        return self.overlap_blocks + self.host_credit * self.host_overlap_blocks

    def cache_usage(self) -> float:
        if self.kv_total_blocks <= 0:
            return self.gpu_cache_usage_perc
        return min(1.0, self.gpu_cache_usage_perc + self.pending_blocks / self.kv_total_blocks)

    def waiting(self) -> int:
        return self.num_requests_waiting + self.pending_requests


@dataclass(frozen=True, slots=True)
class Terms:
    """One candidate's terms in the rule, as the decision saw them: what `explain` reports."""

    worker_id: str
    overlap_blocks: int
    cache_usage: float
    waiting: int
    logit: float
    host_overlap_blocks: int = 0
    host_credit: float = 0.0


def overlap_ratio(overlap_blocks: float, block_size: int, num_tokens: int) -> float:
    """The share of the prompt's tokens held in the matched blocks (the prefix hit rate)."""
    return min(1.0, overlap_blocks * block_size / num_tokens) if num_tokens else 0.0


def logits(candidates: Sequence[Candidate], block_size: int, num_tokens: int, w: CostWeights) -> list[float]:
    max_waiting = max((c.waiting() for c in candidates), default=0)
    out = []
    for c in candidates:
        normalized_waiting = c.waiting() / max_waiting if max_waiting else 0.0
        cached = overlap_ratio(c.cached_blocks(), block_size, num_tokens)
        out.append(w.overlap * cached - w.cache_usage * c.cache_usage() - w.waiting * normalized_waiting)
    return out


def terms(candidates: Sequence[Candidate], block_size: int, num_tokens: int, w: CostWeights) -> list[Terms]:
    """Each candidate's terms and logit, in the candidates' order (the numbers `choose` weighs)."""
    scores = logits(candidates, block_size, num_tokens, w)
    return [Terms(c.worker_id, c.overlap_blocks, c.cache_usage(), c.waiting(), s, c.host_overlap_blocks,
                  c.host_credit) for c, s in zip(candidates, scores)]


def ranked(all_terms: Sequence[Terms], chosen_id: str) -> list[Terms]:
    """The chosen worker first, then the others by logit, best first (ties by worker id), so the
    second is the runner-up. The chosen one leads even when it is not the best logit: with a
    temperature the choice is sampled."""
    chosen = [t for t in all_terms if t.worker_id == chosen_id]
    others = sorted((t for t in all_terms if t.worker_id != chosen_id), key=lambda t: (-t.logit, t.worker_id))
    return chosen + others


def choose(candidates: Sequence[Candidate], block_size: int, num_tokens: int, w: CostWeights,
           rng: random.Random) -> Candidate:
    """The candidate the rule picks. What the caller reports of the choice (its overlap, the prefix
    hit rate) it works out from the chosen worker itself, whichever mode picked it."""
    scores = logits(candidates, block_size, num_tokens, w)
    if w.temperature > 0:
        top = max(scores)
        weights = [math.exp((s - top) / w.temperature) for s in scores]
        return candidates[rng.choices(range(len(candidates)), weights=weights)[0]]
    best = max(scores)
    tied = [i for i, s in enumerate(scores) if s == best]
    fewest = min(candidates[i].indexed_blocks for i in tied)
    return candidates[rng.choice([i for i in tied if candidates[i].indexed_blocks == fewest])]
