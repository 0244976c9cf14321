"""The KV-aware cost function: prefer cached prefixes, avoid full caches and long queues.

The cached-share rule (`--cost-model cached-share`, the default: the share of the prompt a worker
caches, against the share of its cache in use and its share of the longest queue; NVIDIA Dynamo's
KV router's older rule, before its block-count cost, which dynamo_cost.py implements for
`--cost-model dynamo`), per candidate worker:

    logit = 2 * overlap_ratio - gpu_cache_usage - normalized_waiting - 2 * lora_weight * min(0.25, load_s / prefill_s)
            + session_bonus

where overlap_ratio is the share of the prompt's tokens the worker already caches and
normalized_waiting its queue length over the longest queue among the candidates. A block the
worker holds in host memory only counts as `host_credit` of a cached block (`host_credit.py`:
what loading it back saves against recomputing it), and the prompt's images whose features its
encoder cache keeps count as the blocks `encoder_credit.py` says they are worth.

The last term weighs the request's LoRA adapter (none for the base model): load_s is 0 where
the worker holds the adapter resident, else what loading it there takes (the worker's estimate,
`LoraAdapterState.load_s`, from the adapter's size and the loads it measured); prefill_s is what
prefilling the whole prompt takes there (its reported `PrefillCost`; a worker that reports none
is taken at `FALLBACK_PREFILL_S_PER_TOKEN` a token). The overlap term values a whole prompt's
prefill at its weight, 2 (`--overlap-weight`, which scales this term alike), so a load that takes
as long as load_s / prefill_s prompts' prefill costs 2 * that: the load is weighed as prefill
time. Capped at `LORA_LOAD_CAP` = 0.25, the term is at most 0.5 with the default weights, half
the queue term's range: between a worker holding the adapter and one that would load it, alike
in cached prefix and cache usage, the holder keeps the adapter's requests until its normalized
queue exceeds the other's by more than 0.5 (the holder's queue the longest: until the other's is
under half of it), and then they spread to the other, which loads it (sooner for a load cheaper
than a quarter of the prompt's prefill). So an adapter hot on one worker spreads to more when
its queue grows. A worker whose adapter slots are all held by running requests must wait for
one before it loads (worker_adapters.py): its load counts 2 s more and its cap doubles, so it is
a last resort. lora_weight is `--lora-weight` (default 1; 0 weighs no adapter:
adapter-blind routing among the workers that know it). Only workers that know the adapter are
candidates at all (router.py).

session_bonus is `--session-weight` (default 1) on the worker the request's agent session is bound
to (or, for a sub-agent bound nowhere yet, its parent's), 0 elsewhere (session_bindings.py): a soft
binding the load terms outweigh only when that worker is much busier than another.

The best logit wins; among equal logits the worker caching the fewest blocks (so new prefixes spread over
the pool's cache), then chance. With a temperature > 0 the choice is sampled from softmax(logit / T).

Beyond that rule: its load inputs lag behind by up to one metrics period, so a burst of
requests sharing a prefix would all see the same idle worker. The router therefore adds the
requests and blocks it dispatched itself since the worker's last report (`pending_*`), and takes
an adapter it sent a request of to a worker lately as resident there (worker_adapters.py), so a
burst of one adapter's requests does not load it on every worker at once.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from services.config_error import ConfigError


class CostModel(StrEnum):
    """The rule a `kv` router scores workers with (`--cost-model`)."""

    # This module's: cached share of the prompt against cache usage and queue.
    CACHED_SHARE = "cached-share"
    # NVIDIA Dynamo's: blocks to prefill plus blocks to decode (dynamo_cost.py).
    DYNAMO = "dynamo"


# The flag's choices, as written on a command line.
COST_MODELS = tuple(m.value for m in CostModel)
# The most an adapter load counts, in prompts' prefill (the module docstring says why 0.25).
LORA_LOAD_CAP = 0.25
# A prompt token's prefill on a worker that reports no prefill cost (vLLM today): the default
# worker profile's (services/profiles/presets/h100-8b.json, an 8B model on one H100: ~16k tokens/s).
FALLBACK_PREFILL_S_PER_TOKEN = 60e-6


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
    model: CostModel = CostModel.CACHED_SHARE
    # The Dynamo rule's weight of prefill blocks against decode blocks (its other parameters keep
    # Dynamo's defaults: dynamo_cost.DynamoCostConfig); the cached-share rule ignores it.
    prefill_load_scale: float = 1.0
    # Weight of loading the request's LoRA adapter, in both rules (0: adapter-blind).
    lora: float = 1.0

    def __post_init__(self) -> None:
        # The flag's string is converted where it is parsed (flags.py); a bare string is not a model.
        if not isinstance(self.model, CostModel):
            raise ConfigError(f"--cost-model {self.model!r} is not one of {', '.join(COST_MODELS)}")
        if not (math.isfinite(self.prefill_load_scale) and self.prefill_load_scale >= 0):
            raise ConfigError(f"--prefill-load-scale must be finite and >= 0, got {self.prefill_load_scale}")
        if not (math.isfinite(self.lora) and self.lora >= 0):
            raise ConfigError(f"--lora-weight must be finite and >= 0, got {self.lora}")


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
    # Loading the request's LoRA adapter there: 0 where it is resident (or for the base model).
    adapter_load_s: float = 0.0
    # Every adapter slot there is held by running requests (worker_adapters.py): the cap doubles.
    adapter_slots_busy: bool = False
    # Prefilling the whole prompt there, from its reported prefill cost (None: it reports none).
    prompt_prefill_s: float | None = None
    # The request's agent session is bound here (or its parent's, for a sub-agent): the soft
    # preference, added to the logit (session_bindings.py; 0 elsewhere).
    session_bonus: float = 0.0
    # The prompt's images its encoder cache holds, in cached blocks they are worth (encoder_credit.py).
    encoder_blocks: float = 0.0

    def cached_blocks(self) -> float:
        return self.overlap_blocks + self.host_credit * self.host_overlap_blocks + self.encoder_blocks

    def cache_usage(self) -> float:
        if self.kv_total_blocks <= 0:
            return self.gpu_cache_usage_perc
        return min(1.0, self.gpu_cache_usage_perc + self.pending_blocks / self.kv_total_blocks)

    def waiting(self) -> int:
        return self.num_requests_waiting + self.pending_requests

    def prefill_s_per_token(self, num_tokens: int) -> float:
        """A prompt token's prefill here: the prompt's reported prefill over its tokens, else the fallback."""
        if self.prompt_prefill_s is None or self.prompt_prefill_s <= 0 or num_tokens <= 0:
            return FALLBACK_PREFILL_S_PER_TOKEN
        return self.prompt_prefill_s / num_tokens

    def adapter_load_prompts(self, num_tokens: int) -> float:
        """Loading the adapter here, in prefills of the whole prompt (load_s / prefill_s; uncapped)."""
        if self.adapter_load_s <= 0:
            return 0.0
        return self.adapter_load_s / (self.prefill_s_per_token(num_tokens) * max(1, num_tokens))


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
    # The prompt's images its encoder cache keeps, in the cached blocks they are worth.
    encoder_blocks: float = 0.0


def overlap_ratio(overlap_blocks: float, block_size: int, num_tokens: int) -> float:
    """The share of the prompt's tokens held in the matched blocks (the prefix hit rate)."""
    return min(1.0, overlap_blocks * block_size / num_tokens) if num_tokens else 0.0


def logits(candidates: Sequence[Candidate], block_size: int, num_tokens: int, w: CostWeights) -> list[float]:
    max_waiting = max((c.waiting() for c in candidates), default=0)
    out = []
    for c in candidates:
        normalized_waiting = c.waiting() / max_waiting if max_waiting else 0.0
        cached = overlap_ratio(c.cached_blocks(), block_size, num_tokens)
        out.append(w.overlap * cached - w.cache_usage * c.cache_usage() - w.waiting * normalized_waiting
                   - adapter_penalty(c, num_tokens, w) + c.session_bonus)
    return out


def adapter_penalty(c: Candidate, num_tokens: int, w: CostWeights) -> float:
    """The cached-share rule's LoRA term: overlap weight * lora weight * min(LORA_LOAD_CAP, load_s / prefill_s)."""
    if c.adapter_load_s <= 0 or w.lora == 0:
        return 0.0
    cap = LORA_LOAD_CAP * (2 if c.adapter_slots_busy else 1)
    return w.overlap * w.lora * min(cap, c.adapter_load_prompts(num_tokens))


def terms(candidates: Sequence[Candidate], block_size: int, num_tokens: int, w: CostWeights) -> list[Terms]:
    """Each candidate's terms and logit, in the candidates' order (the numbers `choose` weighs)."""
    scores = logits(candidates, block_size, num_tokens, w)
    return [Terms(c.worker_id, c.overlap_blocks, c.cache_usage(), c.waiting(), s, c.host_overlap_blocks,
                  c.host_credit, c.encoder_blocks) for c, s in zip(candidates, scores)]


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
