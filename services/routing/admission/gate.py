"""Admission to a pool: a request either gets a worker with room now, waits in the fair queue
until one has room, or is refused at once because it would miss its objective.

- A worker has room while its requests (running, waiting in its own queue, and dispatched but
  not yet reported) are fewer than its slots plus `worker_queue`: its own queue stays short,
  and everything else waits here, where the choice of worker is made when one frees up, so a
  request that waited still goes to the best cache among the workers with room.
- A request that would wait is refused (OUTCOME_OVERLOADED, with when to retry) when its
  predicted time to first token (prediction.py) exceeds its objective, when the queue is full,
  or when its tenant is at a limit (tenant_usage.py). Its objective is its own (Qos) or the
  deployment's; without either it may wait up to the queue's bound.
- An admitted request holds its place on the worker until the caller ends its call (a
  `Ticket`), so this router knows its own requests' ends at once, and how long they take.

With several routers serving one pool each keeps its own queue, and the processors spread their
requests over the routers in turn, so each sees about an equal part of every tenant's traffic:
fair shares hold across the mesh, and each router enforces `1 / routers` of a tenant's limits.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass


from gen.kvmesh.v1 import common_pb2
from services.kv_protocol.hashing import adapter_seed, local_block_hashes
from services.config_error import ConfigError
from services.mesh.session_kind import CallError
from services.routing.admission.admission_metrics import AdmissionMetrics
from services.routing.admission.fair_queue import Entry, FairQueue
from services.routing.admission.forecaster import NO_WAIT, Forecast, Forecaster, Standing
from services.routing.admission.prediction import prefill_s
from services.routing.admission.tenant_policy import DEFAULT_TENANT, PolicyFile
from services.routing.admission.tenant_usage import LimitHit, TenantUsage
from services.routing.route_query import RouteQuery
from services.routing.worker_pool import WorkerPool, WorkerState

log = logging.getLogger(__name__)

# How long a request may wait when neither it nor the deployment sets an objective.
MAX_QUEUE_WAIT_S = 30.0
# The shortest Retry-After a refusal carries: sooner than this the queue has not moved.
MIN_RETRY_AFTER_S = 0.05
# An admitted request that waits past this many times its objective is refused after all.
EXPIRY = 2.0
# How often the tenant policy file is checked for a change.
POLICY_CHECK_S = 1.0


@dataclass(frozen=True)
class AdmissionConfig:
    # The deployment's time-to-first-token objective (None: only requests that set one have one).
    ttft_objective_s: float | None = None
    # Requests a worker may hold beyond its slots, in its own queue: one ready to start when a
    # slot frees, covering the moment until this router hears of it.
    worker_queue: int = 1
    # Requests waiting here at most (per pool), whatever their objectives.
    max_queued: int = 4096
    # The longest any request may wait here.
    max_queue_wait_s: float = MAX_QUEUE_WAIT_S
    tenant_policies: str | None = None

    def __post_init__(self) -> None:
        if self.ttft_objective_s is not None and not self.ttft_objective_s > 0:
            raise ConfigError(f"--ttft-objective-ms must be > 0, got {self.ttft_objective_s * 1000:g}")
        if self.worker_queue < 0:
            raise ConfigError(f"--worker-queue must be >= 0, got {self.worker_queue}")
        if self.max_queued < 1:
            raise ConfigError(f"--max-queued must be >= 1, got {self.max_queued}")
        if not self.max_queue_wait_s > 0:
            raise ConfigError(f"--max-queue-wait must be > 0, got {self.max_queue_wait_s}")


@dataclass(eq=False, slots=True)
class Queued:
    """A request waiting in the queue: `wait` on it."""

    future: asyncio.Future[None]
    query: RouteQuery
    tenant: str
    streams: int
    since: float
    limit_s: float
    queue: FairQueue[Queued]
    # When it was forecast to leave the queue, counted from `since` (what `late` learns from).
    forecast_s: float
    entry: Entry[Queued] | None = None
    # Woken for a worker with room (counted in `Admission._woken` until it takes it or leaves).
    woken: bool = False


class Ticket:
    """An admitted request's place: `eligible` says which workers it may go to, `placed` where it
    went, `release` (idempotent) gives the place back at the request's end."""

    __slots__ = ("_gate", "tenant", "streams", "waited_s", "worker_id", "_since", "_released")

    def __init__(self, gate: Admission, tenant: str, streams: int, waited_s: float = 0.0) -> None:
        self._gate = gate
        self.tenant = tenant
        self.streams = streams
        # How long it waited in the queue.
        self.waited_s = waited_s
        self.worker_id: str | None = None
        self._since = time.monotonic()
        self._released = False

    def eligible(self, worker: WorkerState) -> bool:
        return self._gate.room(worker) > 0

    def placed(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self._since = time.monotonic()
        own = self._gate.own
        own[worker_id] = own.get(worker_id, 0) + self.streams
        self._gate.pump()  # the room its wake-up held is counted on the worker now
    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._gate.ended(self, time.monotonic() - self._since)


class Admission:
    def __init__(self, pool: WorkerPool, config: AdmissionConfig, metrics: AdmissionMetrics,
                 policies: PolicyFile | None = None, routers: Callable[[], int] = lambda: 1) -> None:
        self._pool = pool
        self.config = config
        self._metrics = metrics
        # How many routers share the pool (their limits are divided among them).
        self._routers = routers
        self.policies = policies if policies is not None else PolicyFile(config.tenant_policies)
        self._queues: dict[str, FairQueue[Queued]] = {}
        self.usage = TenantUsage()
        self.forecaster = Forecaster(config.ttft_objective_s or 1.0)
        # Streams this router placed on each worker and not yet released, and those released
        # since the worker's last load report (which still counts them).
        self.own: dict[str, int] = {}
        self._released: dict[str, int] = {}
        # Per model, the streams of waiters woken for a worker with room that have not taken it yet.
        self._woken: dict[str, int] = {}
        # Set at the router's drain: the places then given back say nothing of the pool.
        self.draining = False
        pool.add_load_listener(self._reported)
        metrics.follow(self.queued, self.predicted_wait_now, lambda: self.policies.reloads,
                       lambda: self.policies.errors)

    async def follow_policies(self, every_s: float = POLICY_CHECK_S) -> None:
        """Reads the tenant policy file again whenever it changes (the runner owns this task)."""
        while True:
            await asyncio.sleep(every_s)
            self.policies.refresh()

    # -- capacity ----------------------------------------------------------------------------

    def room(self, w: WorkerState) -> float:
        slots = w.load.request_total_slots
        if not slots:
            return math.inf  # a worker that does not say: never held back
        return slots + self.config.worker_queue - self.occupancy(w)

    def occupancy(self, w: WorkerState) -> float:
        """The worker's requests as best known: its last report (everyone's, other routers'
        too) plus what was dispatched since, less what this router saw end since; never less
        than this router's own."""
        wid = w.info.instance_id
        reported = w.load.request_active_slots + w.load.num_requests_waiting + len(w.pending)
        return max(self.own.get(wid, 0), reported - self._released.get(wid, 0))

    def _reported(self, instance_id: str) -> None:
        self._released.pop(instance_id, None)
        self.pump()

    def _free(self, model: str) -> float:
        return sum(max(0.0, self.room(w)) for w in self._pool.candidates(model)) - self._woken.get(model, 0)

    def _free_anywhere(self) -> float:
        return sum(max(0.0, self.room(w)) for w in self._pool.workers.values())

    def slots(self, model: str) -> int:
        return sum(w.load.request_total_slots for w in self._pool.candidates(model))

    def queued(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def predicted_wait_s(self, model: str, band: int = 0, tenant: str = DEFAULT_TENANT) -> float:
        """What a new request of `tenant` in `band` would wait now for its first step on a
        worker (0 while a worker has room)."""
        return self._forecast(model, band, tenant).start_s

    def _forecast(self, model: str, band: int, tenant: str) -> Forecast:
        queue = self._queues.get(model)
        if (queue is None or not len(queue)) and self._free(model) > 0:
            return NO_WAIT
        candidates = self._pool.candidates(model)
        standing = Standing(
            ahead=queue.ahead_of(band, tenant) if queue is not None else 0.0,
            own=queue.waiting(band, tenant) if queue is not None else 0,
            on_workers=sum(max(0.0, self.occupancy(w) - w.load.request_total_slots) for w in candidates),
            worker_queues=self.config.worker_queue * len(candidates), slots=self.slots(model))
        return self.forecaster.forecast((model, band, tenant), standing)

    def predicted_wait_now(self) -> float:
        models = sorted({w.info.model for w in self._pool.workers.values()})
        return self.predicted_wait_s(models[0]) if models else 0.0

    # -- admitting ---------------------------------------------------------------------------

    async def enter(self, query: RouteQuery) -> Ticket:
        """A ticket once the request may go to a worker; CallError OUTCOME_OVERLOADED when refused."""
        started = self.begin(query)
        return started if isinstance(started, Ticket) else await self.wait(started)

    def begin(self, query: RouteQuery) -> Ticket | Queued:
        """At once: a ticket (a worker has room and nobody waits), a place in the queue to `wait`
        on, or the refusal (CallError OUTCOME_OVERLOADED, raised)."""
        qos = query.qos
        tenant = qos.tenant or DEFAULT_TENANT
        policy = self.policies.policies.of(tenant)
        # A tenant's policy bounds its requests' band: none goes sooner than its `top_priority`.
        priority = max(qos.priority, policy.top_priority)
        now = time.monotonic()
        streams = max(1, query.streams)
        tokens = len(query.token_ids) + query.max_tokens * streams
        hit = self.usage.check(tenant, policy, tokens, now, 1 / max(1, self._routers()), self.forecaster.hold_s())
        if hit is not None:
            raise self._refused(tenant, hit)
        queue = self._queue(query.model)
        if not len(queue) and self._free(query.model) > 0:
            self.usage.admitted(tenant, tokens, now)
            self._metrics.admitted(tenant, 0.0)
            return Ticket(self, tenant, streams)
        if len(queue) >= self.config.max_queued:
            raise self._refused(tenant, LimitHit(common_pb2.OVERLOAD_QUEUE_FULL, self.predicted_wait_s(query.model),
                                                 f"the queue is full ({len(queue)} requests wait)"))
        objective = qos.ttft_objective_ms / 1000 if qos.ttft_objective_ms else self.config.ttft_objective_s
        forecast = self._forecast(query.model, priority, tenant)
        wait = forecast.start_s
        # After it leaves this queue: its time in the worker's queue and its prefill as modelled,
        # or what the gateway measured of everything outside this queue, if more.
        after = max(forecast.start_s - forecast.leave_s + self._prefill_s(query), qos.outside_queue_ms / 1000)
        if objective is not None and forecast.leave_s + after > objective:
            raise self._refused(tenant, LimitHit(
                common_pb2.OVERLOAD_PREDICTED_LATENCY, forecast.leave_s + after - objective,
                f"predicted time to first token {forecast.leave_s + after:.2f}s (queue {wait:.2f}s) exceeds the "
                f"objective of {objective:.2f}s"))
        limit_s = self.config.max_queue_wait_s
        if query.queue_timeout_s is not None:
            limit_s = min(limit_s, query.queue_timeout_s)
        if objective is not None:
            # Admitted, it is served even a little late (the prediction erred): only one that
            # could not start within `EXPIRY` times its objective is given up.
            limit_s = min(limit_s, max(0.0, EXPIRY * objective - after))
        queued = Queued(asyncio.get_running_loop().create_future(), query, tenant, streams, now, limit_s, queue,
                        forecast.leave_s)
        queued.entry = queue.push(queued, priority, tenant, now + (objective or limit_s), streams)
        self.usage.admitted(tenant, tokens, now)  # in flight from here: a waiting request counts
        return queued

    async def wait(self, queued: Queued) -> Ticket:
        """Waits for the queued request's turn and a worker with room, within its time limit."""
        try:
            # Not wait_for: it returns a result that came with a cancellation and drops the
            # cancellation, and a call whose caller left would then hold its place for ever.
            async with asyncio.timeout(queued.limit_s):
                await queued.future
        except TimeoutError:
            self._gave_up(queued)
            raise self._refused(queued.tenant, LimitHit(
                common_pb2.OVERLOAD_QUEUE_EXPIRED,
                self.predicted_wait_s(queued.query.model, queued.query.qos.priority, queued.tenant),
                f"no worker had room within {queued.limit_s:.2f}s")) from None
        except BaseException:
            self._gave_up(queued)
            raise
        self._unwoken(queued)
        waited = time.monotonic() - queued.since
        band = queued.entry.band if queued.entry is not None else 0
        self.forecaster.came_true((queued.query.model, band, queued.tenant), queued.forecast_s, waited)
        self._metrics.admitted(queued.tenant, waited)
        return Ticket(self, queued.tenant, queued.streams, waited)

    def _gave_up(self, queued: Queued) -> None:
        """A waiter that leaves: out of the queue, or (woken already) its wake-up handed on."""
        entry = queued.entry
        assert entry is not None
        if queued.woken:
            self._unwoken(queued)
        elif not entry.gone:
            queued.queue.remove(entry)
        self.usage.ended(queued.tenant, time.monotonic())
        self.pump()

    def abandon(self, queued: Queued) -> None:
        """A waiter whose caller left before it began to `wait`."""
        if not queued.future.done() or queued.woken:
            self._gave_up(queued)

    def _unwoken(self, queued: Queued) -> None:
        """Its wake-up no longer holds room: it took its place (then counted on the worker:
        `Ticket.placed` pumps), or left (then `_gave_up` pumps)."""
        if queued.woken:
            queued.woken = False
            model = queued.query.model
            self._woken[model] = self._woken.get(model, 0) - queued.streams

    def _refused(self, tenant: str, hit: LimitHit) -> CallError:
        self._metrics.refused(tenant, hit.overload)
        retry_ms = max(1, math.ceil(max(hit.retry_after_s, MIN_RETRY_AFTER_S) * 1000))
        return CallError(common_pb2.OUTCOME_OVERLOADED, hit.message, retry_after_ms=retry_ms,
                         overload=hit.overload)

    def _prefill_s(self, query: RouteQuery) -> float:
        """The prefill on the worker caching most of the prompt (where it would likely go), after
        loading the query's LoRA adapter there if it is not resident (its blocks hash with the
        adapter's seed: only that adapter's cached blocks count)."""
        lora = query.lora_name
        candidates = self._pool.candidates(query.model, lora)
        block_size = self._pool.block_size(query.model)
        if not candidates or not block_size:
            return 0.0
        overlaps = self._pool.index.find_matches(local_block_hashes(query.token_ids, block_size, adapter_seed(lora),
                                                                    query.media))
        best = max(candidates, key=lambda w: overlaps.get(w.info.instance_id, 0))
        cached = min(len(query.token_ids), overlaps.get(best.info.instance_id, 0) * block_size)
        return prefill_s(best.load, len(query.token_ids) - cached, cached) + (best.adapter(lora).load_s if lora else 0.0)

    def _queue(self, model: str) -> FairQueue[Queued]:
        queue = self._queues.get(model)
        if queue is None:
            queue = self._queues[model] = FairQueue(lambda t: self.policies.policies.of(t).weight)
        return queue

    # -- releasing ---------------------------------------------------------------------------

    def ended(self, ticket: Ticket, held_s: float) -> None:
        if ticket.worker_id is not None:
            if not self.draining:  # a drain ends every held place at once: not the requests' ends
                self.forecaster.ended(held_s, pool_full=bool(self.queued()) or self._free_anywhere() <= 0)
                self._released[ticket.worker_id] = self._released.get(ticket.worker_id, 0) + ticket.streams
            left = self.own.get(ticket.worker_id, 0) - ticket.streams
            if left > 0:
                self.own[ticket.worker_id] = left
            else:
                self.own.pop(ticket.worker_id, None)
        self.usage.ended(ticket.tenant, time.monotonic())
        self.pump()

    def pump(self) -> None:
        """Wakes the waiters at the heads of the queues while workers have room for them."""
        for model, queue in self._queues.items():
            while len(queue) and self._free(model) > 0:
                entry = queue.pop()
                assert entry is not None
                queued = entry.item
                if queued.future.done():
                    continue  # its wait timed out this very moment: it leaves by itself
                self.forecaster.departed((model, entry.band, entry.tenant), queue.waiting(entry.band, entry.tenant))
                queued.woken = True
                self._woken[model] = self._woken.get(model, 0) + queued.streams
                queued.future.set_result(None)

    def drain(self) -> None:
        """The router is going away: its waiters are sent on to another router
        (OUTCOME_PEER_DRAINING, which callers retry elsewhere) rather than woken onto workers it no longer follows."""
        self.draining = True
        for queue in self._queues.values():
            while (entry := queue.pop()) is not None:
                if not entry.item.future.done():
                    entry.item.future.set_exception(
                        CallError(common_pb2.OUTCOME_PEER_DRAINING, "the router is draining; ask another"))
