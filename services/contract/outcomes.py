"""When a request is retried, migrated or answered, and with what: the one table.

Every call in the mesh ends with an outcome (common.proto's `Outcome`, carried by `CallError`).
What the caller does about it depends on the hop the call was on and on whether the request had
started to stream there:

| outcome          | gateway->processor | processor->router | processor->decode worker | decode->prefill worker |
| ---------------- | ------------------ | ----------------- | ------------------------ | ---------------------- |
| PEER_GONE        | move, set aside    | move, set aside   | move, set aside          | local, set aside       |
| PEER_DRAINING    | move, set aside    | move, set aside   | move, set aside          | local, set aside       |
| PEER_FAILED      | move, set aside    | move, set aside   | move, set aside          | local                  |
| DEADLINE         | answer             | move, set aside   | answer                   | local, set aside       |
| SESSION_FULL     | move               | move              | move                     | local                  |
| OVERLOADED       | answer             | answer (*)        | answer                   | local                  |
| NO_CAPACITY      | answer             | answer            | answer                   | local                  |
| anything else    | answer             | answer            | answer                   | local                  |

- "move": before the request's first output, the same request goes to another instance (a
  retry); after it, the request continues on another instance with what it produced so far (a
  migration: a processor takeover, or a worker migration). Each caller bounds its moves; past
  the bound it answers.
- "set aside": the instance is kept out of this caller's choices for a while (RecentFailures).
- "local": the decode worker prefills the prompt itself (`fallback_reason` names why).
- "answer": the outcome is the request's answer, in HTTP as `http_answer` says.
- (*) a refusal for a tenant's limits (each router enforces its share of them) is asked of the
  other routers first, and answered only when none has room.
- A deadline on the gateway and worker hops is the request's own: nowhere else to go. On the
  router hop it is that router's (a few seconds): another may answer.

Where a processor answers its gateway, it answers with an outcome the gateway will not move
(a worker's PEER_GONE past the bound becomes NO_WORKER), so a request is moved by one hop only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gen.kvmesh.v1.common_pb2 import (
    OUTCOME_BAD_REQUEST,
    OUTCOME_CANCELLED,
    OUTCOME_CONTEXT_TOO_LONG,
    OUTCOME_DEADLINE,
    OUTCOME_MODEL_NOT_SERVED,
    OUTCOME_NO_CAPACITY,
    OUTCOME_NO_WORKER,
    OUTCOME_OVERLOADED,
    OUTCOME_PEER_DRAINING,
    OUTCOME_PEER_FAILED,
    OUTCOME_PEER_GONE,
    OUTCOME_READ_TOO_SLOWLY,
    OUTCOME_SESSION_FULL,
    OUTCOME_UNSUPPORTED,
    OVERLOAD_PREDICTED_LATENCY,
    OVERLOAD_QUEUE_EXPIRED,
    OVERLOAD_QUEUE_FULL,
    OVERLOAD_TENANT_CONCURRENCY,
    OVERLOAD_TENANT_TOKENS,
    OVERLOAD_UNSPECIFIED,
    Outcome,
    Overload,
)


class Hop(enum.Enum):
    """A kind of call, named by who calls whom."""

    PROCESSOR = "gateway -> processor"
    ROUTER = "processor or decode worker -> router"
    WORKER = "processor -> decode worker"
    PREFILL = "decode worker -> prefill worker"


class Action(enum.Enum):
    ANSWER = "answer"
    # The same request to another instance (nothing streamed yet).
    RETRY = "retry"
    # The request continues on another instance after what it streamed.
    MIGRATE = "migrate"
    # The decode worker prefills the prompt itself.
    PREFILL_LOCALLY = "prefill locally"


@dataclass(frozen=True, slots=True)
class Verdict:
    action: Action
    # Keep the instance out of the caller's choices for a while.
    set_aside: bool


_PEER_LOST = frozenset({OUTCOME_PEER_GONE, OUTCOME_PEER_DRAINING, OUTCOME_PEER_FAILED})

# Per hop: the outcomes after which another instance is tried, and those after which the
# instance is set aside. Every other outcome is answered (or, on the prefill hop, prefilled locally).
# A session full of calls is a busy peer, not a lost one: another may have room, and this one is
# chosen again as soon as its calls end.
_MOVES: dict[Hop, frozenset[Outcome]] = {
    Hop.PROCESSOR: _PEER_LOST | {OUTCOME_SESSION_FULL},
    Hop.ROUTER: _PEER_LOST | {OUTCOME_DEADLINE, OUTCOME_SESSION_FULL},
    Hop.WORKER: _PEER_LOST | {OUTCOME_SESSION_FULL},
    Hop.PREFILL: frozenset(),
}
_SETS_ASIDE: dict[Hop, frozenset[Outcome]] = {
    Hop.PROCESSOR: _PEER_LOST,
    Hop.ROUTER: _PEER_LOST | {OUTCOME_DEADLINE},
    Hop.WORKER: _PEER_LOST,
    # A prefill worker that answered with an error is not gone; one unreachable or too slow is.
    Hop.PREFILL: frozenset({OUTCOME_PEER_GONE, OUTCOME_PEER_DRAINING, OUTCOME_DEADLINE}),
}

# Refusals for a tenant's limits, of which each router enforces its share: asked of the others.
TENANT_LIMITS = frozenset({OVERLOAD_TENANT_CONCURRENCY, OVERLOAD_TENANT_TOKENS})


def verdict(hop: Hop, outcome: Outcome, started: bool = False,
            overload: Overload = OVERLOAD_UNSPECIFIED) -> Verdict:
    """What a caller on `hop` does about a call that ended with `outcome`; `started`: the request
    had streamed output through that instance already."""
    if hop is Hop.PREFILL:
        return Verdict(Action.PREFILL_LOCALLY, outcome in _SETS_ASIDE[hop])
    if hop is Hop.ROUTER and outcome == OUTCOME_OVERLOADED and overload in TENANT_LIMITS:
        return Verdict(Action.RETRY, False)
    if outcome not in _MOVES[hop]:
        return Verdict(Action.ANSWER, False)
    return Verdict(Action.MIGRATE if started else Action.RETRY, outcome in _SETS_ASIDE[hop])


# The label of a remote prefill given up, on kvmesh_decode_prefill_fallback_total.
_FALLBACK_REASONS = {OUTCOME_DEADLINE: "deadline", OUTCOME_NO_CAPACITY: "busy", OUTCOME_SESSION_FULL: "busy"}


def fallback_reason(outcome: Outcome) -> str:
    return _FALLBACK_REASONS.get(outcome, "error")


@dataclass(frozen=True, slots=True)
class HttpAnswer:
    status: int
    # The error body's `code`.
    code: str


_HTTP: dict[Outcome, HttpAnswer] = {
    OUTCOME_BAD_REQUEST: HttpAnswer(400, "invalid_request"),
    OUTCOME_CONTEXT_TOO_LONG: HttpAnswer(400, "context_length_exceeded"),
    OUTCOME_MODEL_NOT_SERVED: HttpAnswer(404, "model_not_found"),
    OUTCOME_OVERLOADED: HttpAnswer(429, "overloaded"),
    # The client (or a hop on its behalf) reads too slowly: it should slow down, as under overload.
    OUTCOME_READ_TOO_SLOWLY: HttpAnswer(429, "overloaded"),
    OUTCOME_NO_WORKER: HttpAnswer(503, "unavailable"),
    OUTCOME_NO_CAPACITY: HttpAnswer(503, "unavailable"),
    OUTCOME_SESSION_FULL: HttpAnswer(503, "unavailable"),
    OUTCOME_PEER_GONE: HttpAnswer(503, "unavailable"),
    OUTCOME_PEER_DRAINING: HttpAnswer(503, "unavailable"),
    OUTCOME_DEADLINE: HttpAnswer(503, "timeout"),
    OUTCOME_CANCELLED: HttpAnswer(503, "cancelled"),
    OUTCOME_PEER_FAILED: HttpAnswer(500, "internal_error"),
    OUTCOME_UNSUPPORTED: HttpAnswer(500, "internal_error"),
}

# The error code of each reason admission refuses a request for.
_OVERLOAD_CODES = {
    OVERLOAD_PREDICTED_LATENCY: "overloaded",
    OVERLOAD_QUEUE_FULL: "overloaded",
    OVERLOAD_QUEUE_EXPIRED: "overloaded",
    OVERLOAD_TENANT_CONCURRENCY: "tenant_concurrency_limit",
    OVERLOAD_TENANT_TOKENS: "rate_limit_exceeded",
}


def http_answer(outcome: Outcome, overload: Overload = OVERLOAD_UNSPECIFIED) -> HttpAnswer:
    """The HTTP status and error code a request answered with `outcome` gets."""
    answer = _HTTP.get(outcome, HttpAnswer(500, "internal_error"))
    code = _OVERLOAD_CODES.get(overload)
    return HttpAnswer(answer.status, code) if code is not None else answer
