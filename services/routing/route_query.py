"""What a router is asked and what it answers, as plain values: the interface of `Router`
(router.py). The wire's RouteRequest and RouteResponse are converted at the edge (wire.py), so a
processor routing in-process (`--routing local`) builds and parses no protobuf per request.

Its refusals are exceptions with names: `NoWorker` (no worker of the pool serves the model, or
the LoRA adapter of it the query names) and
`UnknownPool` (no pool of that role here); admission's (overload) are `CallError`s, as on the wire.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from services.contract.worker_roles import RoleName
from services.kv_protocol.media import MediaSpan
from services.routing.explanation import Explanation
from services.routing.session_bindings import SessionKey


@dataclass(frozen=True, slots=True)
class Qos:
    """What admission weighs of a request's service class (the wire's `Qos`)."""

    # Lower is sooner; bands are served strictly in order.
    priority: int = 0
    # Empty: the default tenant.
    tenant: str = ""
    # The request's own time-to-first-token objective; 0: the deployment's.
    ttft_objective_ms: int = 0
    # What the gateway measured of the first token's latency outside the router's queue; 0: not yet.
    outside_queue_ms: int = 0


@dataclass(frozen=True, slots=True)
class RouteQuery:
    """One request to route: its prompt, the pool, and (for admission) what it will weigh."""

    request_id: str
    model: str
    token_ids: Sequence[int]
    role: RoleName = RoleName.DECODE
    # Workers the caller already tried and wants avoided (retries after a failure).
    exclude: frozenset[str] = frozenset()
    # Return the decision's terms in `Route.explanation`.
    explain: bool = False
    # Admission only (`Router.enter` and `Router.admit`); a plain `decide` ignores them.
    qos: Qos = Qos()
    # Streams the request runs (its choices): its weight on the worker and in the tenant's share.
    streams: int = 1
    # Its generation bound: with the prompt, what a tenant's tokens per minute are charged.
    max_tokens: int = 0
    # The longest the caller lets it wait in the queue (None: the router's own bound).
    queue_timeout_s: float | None = None
    # The LoRA adapter of `model` it runs with ("" for the base model): its blocks hash with the
    # adapter's seed (services/kv_protocol/hashing.py), and only workers knowing it are candidates.
    lora_name: str = ""
    # The agent session it belongs to (session_bindings.py); None: none.
    session: SessionKey | None = None
    # Where its images stand in token_ids: their blocks hash with them (kv_protocol/media.py).
    media: tuple[MediaSpan, ...] = ()
    # Workers the caller saw failing lately: passed over while any other candidate serves the
    # query, taken when none does (a failure list must not refuse a request a worker can serve).
    avoid: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Route:
    """The worker chosen for a query, and what the caller's rules read of the choice."""

    worker_id: str
    address: str
    # Prompt blocks the worker caches on its device, and those after them it holds in host memory only.
    overlap_blocks: int
    host_overlap_blocks: int
    # Share of the prompt's tokens the worker need not compute (a host block counted at its credit).
    prefix_hit_rate: float
    # Requests waiting across the pool as this query found it (the prefill queue size, for prefill).
    pool_waiting: int
    # Set when the query asked to `explain`.
    explanation: Explanation | None = None
    # How long admission kept the request waiting for a worker with room.
    queue_wait_ms: int = 0
    # A session's request: how long the worker should keep the session's blocks (0: not at all).
    session_retain_ms: int = 0


@dataclass(frozen=True, slots=True)
class Matches:
    """Per worker serving the model, the prompt's blocks it caches (Dynamo's `find_matches`)."""

    # 0: nobody serves the model (and nothing matched).
    block_size: int = 0
    device: Mapping[str, int] = field(default_factory=dict)
    # The matched blocks held in host memory and not on the device.
    host: Mapping[str, int] = field(default_factory=dict)


class NoWorker(LookupError):
    """No worker of the pool serves the model (or its LoRA adapter the query names), after the
    caller's exclusions. Every router sees the same pools, so another router would answer the
    same: the caller must not retry the request elsewhere (OUTCOME_NO_WORKER on the wire)."""


class UnknownPool(LookupError):
    """This router follows no pool of the role asked for (a processor routing locally follows the
    decode pool only)."""

    def __init__(self, role: RoleName) -> None:
        super().__init__(f"no {role} pool here")
        self.role = role
