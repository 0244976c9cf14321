"""NVIDIA Dynamo 1.7's worker cost, beside the cached-share rule (`--cost-model dynamo`): the cheapest
worker wins.

The rule, per candidate worker, in KV blocks (lower is better):

    cost = prefill_load_scale * adjusted_prefill_blocks + decode_blocks
    adjusted_prefill_blocks = max(0, queued_prefill_blocks + prompt_blocks
                                     - overlap_score_credit * device_overlap_blocks
                                     - host_cache_hit_weight * host_overlap_blocks
                                     - encoder_blocks)
                              + lora_weight * adapter_load_blocks
    decode_blocks = active_blocks + incoming_blocks
    adapter_load_blocks = load_s / block_prefill_s

Dynamo's defaults: prefill_load_scale 1, overlap_score_credit 1, host_cache_hit_weight 0.75 (kvmesh's
`--host-overlap-weight`, when given, replaces it, as it replaces the cached-share rule's derived
host credit). With temperature 0 the lowest cost wins, exact ties at random; with T > 0 the costs are first
scaled onto [0, 1] by the candidates' range, c' = (c - min) / (max - min), and the choice sampled
from softmax(-c' / T) (all costs equal: uniform). Scaling makes T mean the same whatever the
block counts; it is Dynamo's too.

encoder_blocks is kvmesh's, not Dynamo's: the prompt's images whose features the worker's encoder
cache keeps, at the blocks encoder_credit.py says they are worth.

adapter_load_blocks is kvmesh's, not Dynamo's: loading the request's LoRA adapter (load_s: 0 where
the worker holds it resident, else its estimate, `LoraAdapterState.load_s`) counted as the blocks
whose prefill takes as long there (block_prefill_s: the prompt's prefill at the worker's reported
`PrefillCost` over its blocks, else cost_function.FALLBACK_PREFILL_S_PER_TOKEN * block size),
added after the cached credit, which takes nothing off a load. lora_weight is `--lora-weight`
(default 1, 0: adapter-blind). Uncapped, unlike the cached-share rule's term: blocks of load weigh
against blocks of queue directly, so a holder keeps an adapter's requests until its queued blocks exceed
a non-holder's by the load's. An adapter this router sent a request of to the worker lately
counts as resident there (worker_adapters.py), as its pending blocks count as queued.

How each of Dynamo's terms maps onto what a kvmesh router knows (worker_pb2.LoadMetrics, and the
requests it dispatched since the worker's last report, WorkerState.pending):
- prompt_blocks: the prompt's tokens / block size (a fraction for a partial last block, as Dynamo).
- device / host overlap blocks: the index's `find_matches_by_tier`, as the cached-share rule reads them.
- queued_prefill_blocks (Dynamo: prompt work already on the worker, until its first token):
  the uncached blocks of the requests this router dispatched but the worker has not reported
  (`pending_blocks`, exact), plus the worker's reported waiting requests at the mean blocks of a
  running one (`kv_active_blocks / request_active_slots`; the incoming prompt's blocks when none
  runs). APPROXIMATED: a worker reports how many wait, not their uncached tokens, and nothing of
  a running request's unfinished (chunked) prefill, so both are estimated or left out.
- active_blocks (Dynamo: KV blocks of the worker's active sequences): the reported
  `kv_active_blocks` plus the pending blocks (not yet in the report).
- incoming_blocks (Dynamo: the blocks the request adds to them): prompt blocks less the
  device-held prefix. APPROXIMATED: Dynamo counts only blocks not already active on the
  worker; a cached but idle prefix block becomes active again, yet is not counted here.
Dynamo's disk tier, shared cache, overlap-credit decay and per-request decode weight (defaults
0.25, none, 0, 0) have no kvmesh counterpart and are left out.

For `explain`, each candidate's logit is the negated cost, so the best logit is still the pick.

The default stays `cached-share`: Dynamo's rule would have to win on prefix reuse and TTFT p99 on
both of bench/routing/cost_models.py's workloads, and won on neither (two repeats each; the table is in
bench/results/routing_cost_models.json). On Mooncake's conversation trace it cut TTFT (p50 x0.91,
p99 x0.80) but reused less (x0.89); on the shared-prefix workload it reused less (x0.97) and its
TTFT p99 was x2.6: counting a running request's held blocks as decode cost, block for block
against prefill, it sends a prompt away from the worker caching 2,048 of its 2,304 tokens once
that worker runs two more requests than an idle one, where the cached-share rule waits for the
cached worker.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from services.config_error import ConfigError
from services.routing.cost_function import Candidate, Terms


@dataclass(frozen=True)
class DynamoCostConfig:
    prefill_load_scale: float = 1.0
    # What one device-held prefix block takes off the prompt's prefill (Dynamo allows > 1).
    overlap_score_credit: float = 1.0
    # What one host-held prefix block takes off (at most a device block's 1).
    host_cache_hit_weight: float = 0.75
    # Weight of the blocks loading the request's LoRA adapter is worth (kvmesh's; 0: adapter-blind).
    lora_weight: float = 1.0

    def __post_init__(self) -> None:
        for flag, value in (("--prefill-load-scale", self.prefill_load_scale),
                            ("overlap_score_credit", self.overlap_score_credit), ("--lora-weight", self.lora_weight)):
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{flag} must be finite and >= 0, got {value}")
        if not 0 <= self.host_cache_hit_weight <= 1:
            raise ConfigError(f"host_cache_hit_weight must be within 0..1, got {self.host_cache_hit_weight}")


@dataclass(frozen=True, slots=True)
class Breakdown:
    """One candidate's terms in the rule, in blocks."""

    prompt_blocks: float
    credit_blocks: float
    queued_prefill_blocks: float
    active_blocks: float
    incoming_blocks: float
    prefill_load_scale: float
    # Loading the request's LoRA adapter, in blocks of prefill, weighted (0: resident, or none).
    adapter_blocks: float = 0.0

    @property
    def adjusted_prefill_blocks(self) -> float:
        return max(0.0, self.queued_prefill_blocks + self.prompt_blocks - self.credit_blocks) + self.adapter_blocks

    @property
    def decode_blocks(self) -> float:
        return self.active_blocks + self.incoming_blocks

    @property
    def cost(self) -> float:
        return self.prefill_load_scale * self.adjusted_prefill_blocks + self.decode_blocks


def breakdown(c: Candidate, block_size: int, num_tokens: int, config: DynamoCostConfig) -> Breakdown:
    prompt_blocks = num_tokens / block_size
    credit = (config.overlap_score_credit * c.overlap_blocks + config.host_cache_hit_weight * c.host_overlap_blocks
              + c.encoder_blocks)
    per_waiting = c.kv_active_blocks / c.num_requests_running if c.num_requests_running else prompt_blocks
    queued = c.pending_blocks + c.num_requests_waiting * per_waiting
    incoming = max(0.0, prompt_blocks - c.overlap_blocks)
    return Breakdown(prompt_blocks, credit, queued, c.kv_active_blocks + c.pending_blocks, incoming,
                     config.prefill_load_scale, adapter_load_blocks(c, block_size, num_tokens) * config.lora_weight)


def adapter_load_blocks(c: Candidate, block_size: int, num_tokens: int) -> float:
    """Loading the request's adapter on the worker, as the blocks whose prefill takes as long there."""
    if c.adapter_load_s <= 0:
        return 0.0
    return c.adapter_load_s / (c.prefill_s_per_token(num_tokens) * block_size)


def costs(candidates: Sequence[Candidate], block_size: int, num_tokens: int, config: DynamoCostConfig) -> list[float]:
    # An agent session's bound worker (session_bindings.py): `session_bonus` whole prompts of
    # prefill off its cost, kvmesh's as the adapter term is.
    return [breakdown(c, block_size, num_tokens, config).cost
            - config.prefill_load_scale * c.session_bonus * num_tokens / block_size for c in candidates]


def terms(candidates: Sequence[Candidate], block_size: int, num_tokens: int, config: DynamoCostConfig) -> list[Terms]:
    """Each candidate's terms, its logit the negated cost, in the candidates' order."""
    return [Terms(c.worker_id, c.overlap_blocks, c.cache_usage(), c.waiting(), -cost, c.host_overlap_blocks,
                  config.host_cache_hit_weight if c.host_overlap_blocks else 0.0, c.encoder_blocks)
            for c, cost in zip(candidates, costs(candidates, block_size, num_tokens, config))]


def pick_index(scores: Sequence[float], temperature: float, rng: random.Random) -> int:
    """The index of the cost chosen: the lowest (exact ties at random) at temperature 0, else a
    draw from softmax(-c' / T) over the costs scaled onto [0, 1]."""
    low, high = min(scores), max(scores)
    if temperature > 0:
        if high == low:
            return rng.randrange(len(scores))
        weights = [math.exp(-(s - low) / (high - low) / temperature) for s in scores]
        return rng.choices(range(len(scores)), weights=weights)[0]
    return rng.choice([i for i, s in enumerate(scores) if s == low])


def choose(candidates: Sequence[Candidate], block_size: int, num_tokens: int, config: DynamoCostConfig,
           temperature: float, rng: random.Random) -> Candidate:
    return candidates[pick_index(costs(candidates, block_size, num_tokens, config), temperature, rng)]
