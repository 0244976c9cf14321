"""The router: picks a worker for each tokenized prompt, with the picker of the mode it was built
with, and reports the chosen worker's cached prefix whatever the mode.

`kv` mode scores every eligible worker with the cost function (cached prefix vs load); with no
cached prefix anywhere that reduces to least-loaded. `round-robin` and `random` ignore the
cache for the choice but still report the chosen worker's overlap, which the decode worker's
disaggregation decision uses (services/routing/pickers/ holds the modes).

A query naming a LoRA adapter (`lora_name`) hashes its prompt with the adapter's seed, so it
matches only blocks that adapter computed, and is offered only to the workers that know the
adapter (none: `NoWorker` naming it); the cost function weighs whether each holds it resident
(worker_adapters.py keeps what the workers report of their adapters, and the adapters this router
sent them since).

It decides on plain values (route_query.py), so the same object serves the kv-router process's
gRPC servicer (servicer.py converts the wire) and a processor routing in-process. No eligible
worker is `NoWorker`: every router sees the same pools, so another would answer the same.

A request to the decode pool may go through admission (admission/gate.py): `enter` (or `admit`,
which also waits) gives a ticket, or a place in the queue, or the refusal; `place` then decides
among the workers with room. Each decision can say why (explanation.py): in the caller's `route`
span when traced, in a DEBUG log line, and in the route when the query set `explain`.

Each decision to the decode pool also remembers what it predicted the chosen worker reuses of
the prompt (index_accuracy.py); the processor reports what the engine found (`report`), and the
two make the worker's index accuracy (its pool's `accuracy`, forgotten when it leaves the pool).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence

from opentelemetry.trace import INVALID_SPAN, Span

from services.contract.worker_roles import RoleName
from services.kv_protocol.hashing import LocalBlockHash, adapter_seed, local_block_hashes
from services.routing.admission.gate import Admission, Queued, Ticket
from services.routing.config import RouterConfig
from services.routing.cost_function import overlap_ratio
from services.routing.explanation import Explanation, Provenance, explain
from services.routing.encoder_credit import encoder_blocks
from services.routing.host_credit import host_credits
from services.routing.kv_source import KvSource
from services.routing.index_accuracy import RecentPredictions, Sample, reusable_tokens
from services.routing.pickers import PickContext, make_picker
from services.routing.route_query import Matches, NoWorker, Route, RouteQuery, UnknownPool
from services.routing.router_metrics import RouterMetrics
from services.routing.worker_pool import WorkerPool, WorkerState
from services.mesh.discovery import InstanceInfo
from services.routing.session_bindings import Preference, SessionBindings
from gen.kvmesh.v1 import common_pb2

log = logging.getLogger(__name__)

# The pools whose callers report what the engine found (the processor, for the decode pool; a
# decode worker reports nothing of the prefill routings it asks for).
REPORTED_ROLES = frozenset({RoleName.DECODE})


class Router:
    def __init__(self, pools: Mapping[RoleName, WorkerPool], config: RouterConfig, metrics: RouterMetrics,
                 admission: Admission | None = None, sessions: SessionBindings | None = None) -> None:
        self._pools = pools
        # Agent sessions' bindings to workers (decode pool only); None: sessions are ignored.
        self._sessions = sessions if sessions is not None and sessions.active else None
        if self._sessions is not None:
            metrics.session_bindings.set_function(self._sessions.live)
        # The decode pool's queue and admission, for the requests that go through it.
        self._admission = admission
        self._metrics = metrics
        self._mode = config.mode
        # One generator for every random draw of the router, so a seed fixes all its choices.
        self._picker = make_picker(config.mode, random.Random(config.seed), config.weights)
        self._host_weight = config.weights.host_overlap
        self._media_aware = config.media_aware
        # Each decision's prediction until its report (the accuracy it makes is the pool's).
        self._predictions = RecentPredictions()
        for pool in pools.values():
            pool.view.add_listener(self._on_member)

    def admits(self, role: RoleName) -> bool:
        """Whether requests to this pool may go through admission (`enter`, `admit`)."""
        return self._admission is not None and role is RoleName.DECODE

    # -- deciding ----------------------------------------------------------------------------

    def _as_seen(self, query: RouteQuery) -> RouteQuery:
        """The query as this router weighs it: without its images under --no-media-aware-routing
        (its admission's estimates too)."""
        return query if self._media_aware or not query.media else dataclasses.replace(query, media=())

    def decide(self, query: RouteQuery, span: Span = INVALID_SPAN) -> Route:
        """One decision, at once, outside admission (retries, migrations, the prefill pool: work
        already admitted). `span`: the caller's `route` span, which gets the decision's terms."""
        return self._decide(query, span)

    def find_matches(self, role: RoleName, model: str, token_ids: Sequence[int], lora_name: str = "") -> Matches:
        """Per worker serving the model (and its LoRA adapter `lora_name`, when named), the
        prompt's blocks it caches, by tier: blocks computed with that adapter only."""
        pool = self._pool(role)
        block_size = pool.block_size(model)
        if block_size is None:
            return Matches()
        device, host = pool.index.find_matches_by_tier(local_block_hashes(token_ids, block_size, adapter_seed(lora_name)))
        serving = [w.info.instance_id for w in pool.candidates(model, lora_name)]
        return Matches(block_size, {w: device[w] for w in serving if w in device},
                       {w: host[w] for w in serving if w in host})

    def report(self, request_id: str, worker_id: str, cached_tokens: int, prompt_tokens: int | None = None) -> None:
        """What the engine found cached of a prompt this router sent to `worker_id` (its first
        output's cached_tokens): one accuracy sample against the decision's prediction. Ignored
        when there is none (never made here, reported already, or past its bounds) or it was for
        another prompt length (`prompt_tokens`, when given: a request resumed with tokens the
        routing never saw)."""
        prediction = self._predictions.take(request_id, worker_id)
        if prediction is None or (prompt_tokens is not None and prompt_tokens != prediction.prompt_tokens):
            return
        pool = next((p for p in self._pools.values() if worker_id in p.workers), None)
        if pool is None:
            return  # it left while the request ran: no series comes back for it
        if prediction.from_events:
            sample = pool.accuracy.observe(worker_id, prediction.predicted_tokens, cached_tokens)
        else:  # a prediction from the prompts sent there: counted, but it says nothing of the index
            sample = Sample(prediction.predicted_tokens, cached_tokens)
            if prediction.index_tokens is not None:
                pool.agreement(worker_id, Sample(prediction.index_tokens, cached_tokens).ratio)
        self._metrics.record_accuracy(worker_id, sample.ratio, sample.error_tokens, pool.accuracy.recent(worker_id))

    def _remember(self, query: RouteQuery, pool: WorkerPool, chosen: WorkerState, blocks: int,
                  local_hashes: Sequence[LocalBlockHash]) -> None:
        """The decision's prediction for the chosen worker, until its feedback (`report`)."""
        engine, block_size, prompt = chosen.info.engine, chosen.info.block_size, len(query.token_ids)
        wid = chosen.info.instance_id
        index_blocks = pool.index_score(wid, local_hashes)
        index_tokens = None if index_blocks is None else reusable_tokens(index_blocks, block_size, prompt, engine)
        self._predictions.remember(query.request_id, wid, reusable_tokens(blocks, block_size, prompt, engine), prompt,
                                   pool.kv_source(wid) is KvSource.EVENTS, index_tokens)

    def _on_member(self, instance_id: str, info: InstanceInfo | None) -> None:
        if info is None:  # gone from its pool (which forgets its accuracy): its series go too
            self._metrics.forget_worker(instance_id)

    # -- admission ---------------------------------------------------------------------------

    def enter(self, query: RouteQuery) -> Ticket | Queued:
        """At once: a ticket (a worker has room), a place in the queue to `wait` on, or the
        refusal (gate.py). A query no worker serves is refused at once, not queued (`NoWorker`)."""
        admission = self._admitting()
        self._candidates(query)
        return admission.begin(self._as_seen(query))

    async def wait(self, queued: Queued) -> Ticket:
        """Waits for the queued request's turn and a worker with room (or its refusal)."""
        return await self._admitting().wait(queued)

    def abandon(self, queued: Queued) -> None:
        """A queued request whose caller left before it began to `wait`."""
        self._admitting().abandon(queued)

    def place(self, query: RouteQuery, ticket: Ticket, span: Span = INVALID_SPAN) -> Route:
        """Decides among the workers the ticket may take; the ticket is given back if that fails."""
        try:
            route = self._decide(query, span, ticket.eligible)
        except BaseException:
            ticket.release()
            raise
        ticket.placed(route.worker_id)
        return dataclasses.replace(route, queue_wait_ms=round(ticket.waited_s * 1000))

    async def admit(self, query: RouteQuery, span: Span = INVALID_SPAN) -> tuple[Route, Ticket]:
        """Admits the query (waiting for room, or refused), then places it: `enter`, `wait` and
        `place` in one (in-process callers). The ticket is the caller's to release at the end."""
        admission = self._admitting()
        self._candidates(query)
        ticket = await admission.enter(self._as_seen(query))
        return self.place(query, ticket, span), ticket

    def drain(self) -> None:
        """The router is going away: its waiters are sent on to another router (gate.py)."""
        if self._admission is not None:
            self._admission.drain()

    # -- the decision ------------------------------------------------------------------------

    def _admitting(self) -> Admission:
        if self._admission is None:
            raise RuntimeError("this router has no admission (see `admits`)")
        return self._admission

    def _pool(self, role: RoleName) -> WorkerPool:
        pool = self._pools.get(role)
        if pool is None:
            raise UnknownPool(role)
        return pool

    def _candidates(self, query: RouteQuery) -> tuple[WorkerPool, list[WorkerState]]:
        """The query's pool and its workers serving the model (and the query's LoRA adapter, when
        it names one), less the excluded (`NoWorker` if none), and less the avoided while any
        other is left."""
        pool = self._pool(query.role)
        candidates = [w for w in pool.candidates(query.model) if w.info.instance_id not in query.exclude]
        if not candidates:
            self._metrics.no_worker.inc()
            raise NoWorker(f"no {pool.view.component} serves model {query.model!r}")
        if query.lora_name:
            candidates = [w for w in candidates if w.knows_adapter(query.lora_name)]
            if not candidates:
                self._metrics.no_worker.inc()
                raise NoWorker(f"no {pool.view.component} serves LoRA adapter {query.lora_name!r} of model "
                               f"{query.model!r}")
        if query.avoid:
            candidates = [w for w in candidates if w.info.instance_id not in query.avoid] or candidates
        return pool, candidates

    def _decide(self, query: RouteQuery, span: Span, eligible: Callable[[WorkerState], bool] | None = None) -> Route:
        """`eligible`: the workers an admitted request may take (those with room), when any is."""
        started = time.perf_counter()
        pool, candidates = self._candidates(query)
        preference = self._session_preference(query, candidates)
        if preference is not None and preference.only:
            # Hard affinity: its worker alone, with room or not (it waits in the worker's queue).
            candidates = [w for w in candidates if w.info.instance_id == preference.worker_id]
        elif eligible is not None:
            candidates = [w for w in candidates if eligible(w)] or candidates
        block_size = pool.block_size(query.model) or candidates[0].info.block_size
        tokens, lora = query.token_ids, query.lora_name
        # An adapter's blocks hash with its own seed: they match its own cached blocks only.
        media = self._as_seen(query).media
        local_hashes = local_block_hashes(tokens, block_size, adapter_seed(lora), media)
        overlaps, host_overlaps = pool.matches_by_tier(local_hashes)
        credits = host_credits(candidates, overlaps, host_overlaps, block_size, self._host_weight)
        adapters = {w.info.instance_id: w.adapter(lora) for w in candidates} if lora else {}
        context = PickContext(overlaps, block_size, len(tokens), pool.index.block_count, host_overlaps, credits,
                              adapters, *self._session_terms(preference),
                              encoder_blocks=encoder_blocks(candidates, media, overlaps, host_overlaps, block_size))
        chosen = self._picker.pick(candidates, context)
        session_route, retain_ms = self._bind(query, chosen.info.instance_id, preference)
        # Explained only when someone looks: the terms cost a second pass over the candidates. Taken
        # before the pending work below is added, so they are the numbers the pick weighed.
        explanation = None
        if query.explain or span.is_recording() or log.isEnabledFor(logging.DEBUG):
            provenance = {w.info.instance_id: Provenance(pool.kv_source(w.info.instance_id),
                                                         pool.accuracy.recent(w.info.instance_id)) for w in candidates}
            explanation = explain(self._mode, chosen.info.instance_id, self._picker.terms(candidates, context),
                                  provenance, lora, adapters, session_route)
        # The pool's queue as this request finds it (the disaggregation rule's prefill queue size).
        pool_waiting = sum(w.load.num_requests_waiting + len(w.pending) for w in candidates)
        wid = chosen.info.instance_id
        overlap, host_overlap = overlaps.get(wid, 0), host_overlaps.get(wid, 0)
        # Blocks loaded back from host memory take device blocks as recomputed ones do.
        chosen.add_pending(max(0, -(-len(tokens) // block_size) - overlap), lora)
        if media:
            chosen.images.routed(span.digest for span in media)
        # What the prompt need not compute (the disaggregation rule's input): a host-held block
        # counts as much as the cost function credited it.
        hit = overlap_ratio(overlap + credits.get(wid, 0.0) * host_overlap, block_size, len(tokens))
        self._metrics.routed.labels(wid, pool.view.component).inc()
        if lora:
            self._metrics.record_lora(lora, adapters[wid].resident)
        pool.routed(wid, local_hashes)
        self._metrics.record(len(tokens), min(len(tokens), (overlap + host_overlap) * block_size))
        if query.role in REPORTED_ROLES:
            self._remember(query, pool, chosen, overlap + host_overlap, local_hashes)
        self._metrics.decision_seconds.observe(time.perf_counter() - started)
        if explanation is not None:
            self._tell(query, pool, span, hit, explanation)
        return Route(wid, chosen.info.address, overlap, host_overlap, hit, pool_waiting,
                     explanation if query.explain else None, session_retain_ms=retain_ms)

    # -- agent sessions ----------------------------------------------------------------------

    def _session_preference(self, query: RouteQuery, candidates: Sequence[WorkerState]) -> Preference | None:
        """What the query's session asks of this decision (None: no session, or sessions off)."""
        if self._sessions is None or query.session is None or query.role is not RoleName.DECODE:
            return None
        return self._sessions.preference(query.session, (w.info.instance_id for w in candidates))

    def _session_terms(self, preference: Preference | None) -> tuple[str | None, float]:
        if preference is None or preference.worker_id is None or self._sessions is None:
            return None, 0.0
        return preference.worker_id, self._sessions.config.weight

    def _bind(self, query: RouteQuery, worker_id: str,
              preference: Preference | None) -> tuple[common_pb2.SessionRoute, int]:
        """Binds the query's session to the chosen worker: the route it took, and how long the
        worker should keep the session's blocks."""
        if preference is None or query.session is None or self._sessions is None:
            return common_pb2.SESSION_ROUTE_UNSPECIFIED, 0
        route = self._sessions.bind(query.session, worker_id, preference)
        self._metrics.record_session(route)
        return route, self._sessions.config.retain_ms

    def _tell(self, query: RouteQuery, pool: WorkerPool, span: Span, hit: float, explanation: Explanation) -> None:
        """The decision's terms in the DEBUG log and the caller's span."""
        log.debug("request %s (%s): %s", query.request_id, pool.view.component, explanation.log_line())
        if span.is_recording():
            span.set_attributes({"kvmesh.request_id": query.request_id, "kvmesh.route.pool": pool.view.component,
                                 "kvmesh.route.prefix_hit_rate": hit, **explanation.span_attributes()})
