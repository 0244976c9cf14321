"""KV-aware: the cost function picks, from each candidate's cached prefix and load.

A worker's load is its last metrics report plus what this router dispatched to it since (the
pending requests and blocks), so a burst of requests does not all land on the worker that was
idle at the last report. With no cached prefix anywhere this reduces to least-loaded.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from services.routing.cost_function import Candidate, CostWeights, Terms, choose, terms
from services.routing.pickers.base import PickContext
from services.routing.worker_pool import WorkerState


class KvPicker:
    def __init__(self, rng: random.Random, weights: CostWeights) -> None:
        self._rng = rng
        self._weights = weights

    def pick(self, candidates: Sequence[WorkerState], context: PickContext) -> WorkerState:
        chosen = choose([candidate(w, context) for w in candidates], context.block_size, context.num_tokens,
                        self._weights, self._rng)
        return next(w for w in candidates if w.info.instance_id == chosen.worker_id)

    def terms(self, candidates: Sequence[WorkerState], context: PickContext) -> list[Terms]:
        # The same inputs `pick` scores; asked before the pick's pending work is added.
        return terms([candidate(w, context) for w in candidates], context.block_size, context.num_tokens,
                     self._weights)


def candidate(worker: WorkerState, context: PickContext) -> Candidate:
    """The cost function's view of one worker: reported load plus this router's pending work, and
    its host-held blocks of the prompt at the credit the context gives them."""
    pending_requests, pending_blocks = worker.pending_counts()
    load = worker.load
    worker_id = worker.info.instance_id
    return Candidate(
        worker_id=worker_id, overlap_blocks=context.overlaps.get(worker_id, 0),
        kv_active_blocks=load.kv_active_blocks, kv_total_blocks=load.kv_total_blocks,
        num_requests_waiting=load.num_requests_waiting, gpu_cache_usage_perc=load.gpu_cache_usage_perc,
        pending_requests=pending_requests, pending_blocks=pending_blocks,
        indexed_blocks=context.indexed_blocks(worker_id), host_overlap_blocks=context.host_overlaps.get(worker_id, 0),
        host_credit=context.host_credits.get(worker_id, 0.0))
