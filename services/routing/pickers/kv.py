"""KV-aware: a cost rule picks, from each candidate's cached prefix and load.

The rule is the settings' `model`: the cached-share rule (cost_function.py: the share of the
prompt a worker caches against its cache usage and queue) or NVIDIA Dynamo's (dynamo_cost.py:
blocks to prefill plus blocks to decode). Both see the same candidates: a worker's load is its
last metrics report plus what this router dispatched to it since (the pending requests and
blocks), so a burst of requests does not all land on the worker that was idle at the last
report. With no cached prefix anywhere either reduces to least-loaded. A request of a LoRA
adapter also weighs loading it where it is not resident (the context's `adapters`), in each
rule's units.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

from gen.kvmesh.v1 import worker_pb2
from services.routing import cost_function, dynamo_cost
from services.routing.cost_function import Candidate, CostModel, CostWeights, Terms
from services.routing.dynamo_cost import DynamoCostConfig
from services.kv_protocol.tier import prefill_seconds
from services.routing.pickers.base import PickContext
from services.routing.worker_pool import WorkerState


class KvPicker:
    def __init__(self, rng: random.Random, weights: CostWeights) -> None:
        self._rng = rng
        self._weights = weights
        self._dynamo = dynamo_config(weights) if weights.model is CostModel.DYNAMO else None

    def pick(self, candidates: Sequence[WorkerState], context: PickContext) -> WorkerState:
        scored = [candidate(w, context) for w in candidates]
        if self._dynamo is not None:
            chosen = dynamo_cost.choose(scored, context.block_size, context.num_tokens, self._dynamo,
                                        self._weights.temperature, self._rng)
        else:
            chosen = cost_function.choose(scored, context.block_size, context.num_tokens, self._weights, self._rng)
        return next(w for w in candidates if w.info.instance_id == chosen.worker_id)

    def terms(self, candidates: Sequence[WorkerState], context: PickContext) -> list[Terms]:
        # The same inputs `pick` scores; asked before the pick's pending work is added.
        scored = [candidate(w, context) for w in candidates]
        if self._dynamo is not None:
            return dynamo_cost.terms(scored, context.block_size, context.num_tokens, self._dynamo)
        return cost_function.terms(scored, context.block_size, context.num_tokens, self._weights)


def dynamo_config(weights: CostWeights) -> DynamoCostConfig:
    """The Dynamo rule's parameters: Dynamo's defaults, but for the prefill load scale the settings
    give and `--host-overlap-weight`, when given, as its host weight."""
    config = DynamoCostConfig(prefill_load_scale=weights.prefill_load_scale, lora_weight=weights.lora)
    if weights.host_overlap is None:
        return config
    return dataclasses.replace(config, host_cache_hit_weight=weights.host_overlap)


def candidate(worker: WorkerState, context: PickContext) -> Candidate:
    """The cost rules' view of one worker: reported load plus this router's pending work, and
    its host-held blocks of the prompt at the credit the context gives them, and what loading
    the request's adapter there would take."""
    pending_requests, pending_blocks = worker.pending_counts()
    load = worker.load
    worker_id = worker.info.instance_id
    adapter = context.adapters.get(worker_id)
    load_s = adapter.load_s if adapter is not None and not adapter.resident else 0.0
    busy = adapter is not None and adapter.slots_busy
    return Candidate(
        worker_id=worker_id, overlap_blocks=context.overlaps.get(worker_id, 0),
        kv_active_blocks=load.kv_active_blocks, kv_total_blocks=load.kv_total_blocks,
        num_requests_waiting=load.num_requests_waiting, gpu_cache_usage_perc=load.gpu_cache_usage_perc,
        pending_requests=pending_requests, pending_blocks=pending_blocks,
        num_requests_running=load.request_active_slots,
        indexed_blocks=context.indexed_blocks(worker_id), host_overlap_blocks=context.host_overlaps.get(worker_id, 0),
        host_credit=context.host_credits.get(worker_id, 0.0), adapter_load_s=load_s,
        adapter_slots_busy=busy,
        prompt_prefill_s=prompt_prefill_s(load, context.num_tokens) if load_s > 0 else None,
        session_bonus=context.session_weight if worker_id == context.session_worker else 0.0,
        encoder_blocks=context.encoder_blocks.get(worker_id, 0.0))


def prompt_prefill_s(load: worker_pb2.LoadMetrics, num_tokens: int) -> float | None:
    """Prefilling the whole prompt on the worker, from its reported cost (None: it reports none)."""
    if not load.HasField("prefill_cost"):
        return None
    cost = load.prefill_cost
    return prefill_seconds(cost.us_per_token, cost.us_per_token_per_1k, 0, num_tokens)
