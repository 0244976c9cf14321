"""The outcome table (services/contract/outcomes.py), row by row: what every caller does about
every way a call can end, and the HTTP answer of each outcome. The table in the module's doc is
this test's expectation written out; a change to one must change the other."""

from __future__ import annotations

import pytest

from gen.kvmesh.v1 import common_pb2 as pb
from services.contract.outcomes import (
    Action,
    HttpAnswer,
    Hop,
    Verdict,
    fallback_reason,
    http_answer,
    verdict,
)

ANSWER, RETRY, MIGRATE, LOCAL = Action.ANSWER, Action.RETRY, Action.MIGRATE, Action.PREFILL_LOCALLY
P, R, W, F = Hop.PROCESSOR, Hop.ROUTER, Hop.WORKER, Hop.PREFILL

# outcome: what each hop's caller does before its request streamed anything there, and whether it
# sets the instance aside. Columns: gateway->processor, ->router, processor->worker, decode->prefill.
TABLE: dict[int, tuple[tuple[Action, bool], ...]] = {
    pb.OUTCOME_PEER_GONE: ((RETRY, True), (RETRY, True), (RETRY, True), (LOCAL, True)),
    pb.OUTCOME_PEER_DRAINING: ((RETRY, True), (RETRY, True), (RETRY, True), (LOCAL, True)),
    pb.OUTCOME_PEER_FAILED: ((RETRY, True), (RETRY, True), (RETRY, True), (LOCAL, False)),
    pb.OUTCOME_DEADLINE: ((ANSWER, False), (RETRY, True), (ANSWER, False), (LOCAL, True)),
    pb.OUTCOME_SESSION_FULL: ((RETRY, False), (RETRY, False), (RETRY, False), (LOCAL, False)),
    pb.OUTCOME_OVERLOADED: ((ANSWER, False), (ANSWER, False), (ANSWER, False), (LOCAL, False)),
    pb.OUTCOME_NO_CAPACITY: ((ANSWER, False), (ANSWER, False), (ANSWER, False), (LOCAL, False)),
    pb.OUTCOME_BAD_REQUEST: ((ANSWER, False), (ANSWER, False), (ANSWER, False), (LOCAL, False)),
    pb.OUTCOME_CONTEXT_TOO_LONG: ((ANSWER, False), (ANSWER, False), (ANSWER, False), (LOCAL, False)),
    pb.OUTCOME_NO_WORKER: ((ANSWER, False), (ANSWER, False), (ANSWER, False), (LOCAL, False)),
    pb.OUTCOME_MODEL_NOT_SERVED: ((ANSWER, False), (ANSWER, False), (ANSWER, False), (LOCAL, False)),
    pb.OUTCOME_READ_TOO_SLOWLY: ((ANSWER, False), (ANSWER, False), (ANSWER, False), (LOCAL, False)),
    pb.OUTCOME_CANCELLED: ((ANSWER, False), (ANSWER, False), (ANSWER, False), (LOCAL, False)),
    pb.OUTCOME_UNSUPPORTED: ((ANSWER, False), (ANSWER, False), (ANSWER, False), (LOCAL, False)),
}

HTTP: dict[int, tuple[int, str]] = {
    pb.OUTCOME_BAD_REQUEST: (400, "invalid_request"),
    pb.OUTCOME_CONTEXT_TOO_LONG: (400, "context_length_exceeded"),
    pb.OUTCOME_MODEL_NOT_SERVED: (404, "model_not_found"),
    pb.OUTCOME_OVERLOADED: (429, "overloaded"),
    pb.OUTCOME_READ_TOO_SLOWLY: (429, "overloaded"),
    pb.OUTCOME_NO_WORKER: (503, "unavailable"),
    pb.OUTCOME_NO_CAPACITY: (503, "unavailable"),
    pb.OUTCOME_SESSION_FULL: (503, "unavailable"),
    pb.OUTCOME_PEER_GONE: (503, "unavailable"),
    pb.OUTCOME_PEER_DRAINING: (503, "unavailable"),
    pb.OUTCOME_DEADLINE: (503, "timeout"),
    pb.OUTCOME_CANCELLED: (503, "cancelled"),
    pb.OUTCOME_PEER_FAILED: (500, "internal_error"),
    pb.OUTCOME_UNSUPPORTED: (500, "internal_error"),
}

FAILURES = [o for o in pb.Outcome.values() if o != pb.OUTCOME_OK]


def name(outcome: int) -> str:
    return pb.Outcome.Name(outcome)


def test_the_table_covers_every_outcome_a_call_can_end_with() -> None:
    # A new outcome in common.proto must get a row here (and in the module's table) before it ships.
    assert sorted(TABLE) == sorted(FAILURES) and sorted(HTTP) == sorted(FAILURES)


@pytest.mark.parametrize("outcome", FAILURES, ids=name)
@pytest.mark.parametrize("column, hop", list(enumerate([P, R, W, F])), ids=lambda x: x if isinstance(x, int) else x.name)
def test_each_caller_does_what_the_table_says(outcome: int, column: int, hop: Hop) -> None:
    action, set_aside = TABLE[outcome][column]
    assert verdict(hop, outcome) == Verdict(action, set_aside)


@pytest.mark.parametrize("outcome", FAILURES, ids=name)
@pytest.mark.parametrize("hop", [P, R, W], ids=lambda h: h.name)
def test_a_move_after_output_is_a_migration_and_nothing_else_changes(outcome: int, hop: Hop) -> None:
    before, after = verdict(hop, outcome, started=False), verdict(hop, outcome, started=True)
    assert after.set_aside == before.set_aside
    assert after.action == (MIGRATE if before.action is RETRY else before.action)


@pytest.mark.parametrize("overload", [pb.OVERLOAD_TENANT_CONCURRENCY, pb.OVERLOAD_TENANT_TOKENS])
def test_a_refusal_for_a_tenants_share_is_asked_of_the_other_routers_without_setting_this_one_aside(
        overload: int) -> None:
    assert verdict(R, pb.OUTCOME_OVERLOADED, overload=overload) == Verdict(RETRY, False)
    # Everywhere else it is the answer; so is every other refusal.
    assert verdict(P, pb.OUTCOME_OVERLOADED, overload=overload) == Verdict(ANSWER, False)
    for other in (pb.OVERLOAD_PREDICTED_LATENCY, pb.OVERLOAD_QUEUE_FULL, pb.OVERLOAD_QUEUE_EXPIRED):
        assert verdict(R, pb.OUTCOME_OVERLOADED, overload=other) == Verdict(ANSWER, False)


@pytest.mark.parametrize("outcome", FAILURES, ids=name)
def test_each_outcome_has_its_http_answer(outcome: int) -> None:
    assert http_answer(outcome) == HttpAnswer(*HTTP[outcome])


def test_a_refusals_reason_names_its_error_code() -> None:
    assert http_answer(pb.OUTCOME_OVERLOADED, pb.OVERLOAD_TENANT_CONCURRENCY) == HttpAnswer(429, "tenant_concurrency_limit")
    assert http_answer(pb.OUTCOME_OVERLOADED, pb.OVERLOAD_TENANT_TOKENS) == HttpAnswer(429, "rate_limit_exceeded")
    assert http_answer(pb.OUTCOME_OVERLOADED, pb.OVERLOAD_QUEUE_FULL) == HttpAnswer(429, "overloaded")


def test_a_remote_prefill_given_up_is_counted_under_its_reason() -> None:
    assert [fallback_reason(o) for o in (pb.OUTCOME_DEADLINE, pb.OUTCOME_NO_CAPACITY, pb.OUTCOME_SESSION_FULL,
                                         pb.OUTCOME_PEER_GONE, pb.OUTCOME_PEER_FAILED, pb.OUTCOME_UNSUPPORTED)] == [
        "deadline", "busy", "busy", "error", "error", "error"]
