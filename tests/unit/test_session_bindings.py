"""Agent sessions' bindings (services/routing/session_bindings.py) and what the cost rules make of
them: in-process logic; the etcd mirror and the whole path are in tests/e2e/test_sessions.py."""

from __future__ import annotations

from typing import cast

import pytest

from gen.kvmesh.v1 import common_pb2
from services.config_error import ConfigError
from services.mesh.etcd_store import KeyValueStore, WatchEvent
from services.routing import cost_function, dynamo_cost
from services.routing.cost_function import Candidate, CostWeights
from services.routing.dynamo_cost import DynamoCostConfig
from services.routing.session_bindings import Affinity, Binding, SessionBindings, SessionConfig, SessionKey
from services.routing.session_store import SessionStore, decode, encode, sessions_prefix


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def bindings(affinity: Affinity = Affinity.SOFT, ttl_s: float = 60.0, **kwargs: int) -> tuple[SessionBindings, Clock]:
    clock = Clock()
    return SessionBindings(SessionConfig(affinity, ttl_s), clock, **kwargs), clock


def test_a_new_session_is_bound_where_it_went_and_its_next_request_prefers_that_worker() -> None:
    b, _ = bindings()
    key = SessionKey("s1")
    first = b.preference(key, ["w1", "w2"])
    assert (first.worker_id, first.only, first.route) == (None, False, common_pb2.SESSION_ROUTE_NEW)
    assert b.bind(key, "w2", first) == common_pb2.SESSION_ROUTE_NEW
    second = b.preference(key, ["w1", "w2"])
    assert (second.worker_id, second.only, second.route) == ("w2", False, common_pb2.SESSION_ROUTE_BOUND)
    assert b.bind(key, "w2", second) == common_pb2.SESSION_ROUTE_BOUND


def test_hard_affinity_keeps_to_the_worker_and_soft_chosen_elsewhere_moves_the_binding() -> None:
    hard, _ = bindings(Affinity.HARD)
    hard.bind(SessionKey("s"), "w1", hard.preference(SessionKey("s"), ["w1"]))
    assert hard.preference(SessionKey("s"), ["w1", "w2"]).only
    soft, _ = bindings()
    soft.bind(SessionKey("s"), "w1", soft.preference(SessionKey("s"), ["w1"]))
    pref = soft.preference(SessionKey("s"), ["w1", "w2"])
    assert soft.bind(SessionKey("s"), "w2", pref) == common_pb2.SESSION_ROUTE_MOVED  # outweighed by load
    assert soft.bound("s") == "w2"


def test_a_session_whose_worker_is_gone_or_excluded_moves_with_its_request() -> None:
    b, _ = bindings(Affinity.HARD)
    b.bind(SessionKey("s"), "w1", b.preference(SessionKey("s"), ["w1"]))
    pref = b.preference(SessionKey("s"), ["w2", "w3"])  # w1 failed: the retry excludes it
    assert (pref.worker_id, pref.only, pref.route) == (None, False, common_pb2.SESSION_ROUTE_MOVED)
    assert b.bind(SessionKey("s"), "w3", pref) == common_pb2.SESSION_ROUTE_MOVED
    assert b.bound("s") == "w3"


def test_a_sub_agent_prefers_its_parents_worker_until_it_has_a_binding_of_its_own() -> None:
    b, _ = bindings(Affinity.HARD)
    b.bind(SessionKey("parent"), "w2", b.preference(SessionKey("parent"), ["w1", "w2"]))
    child = SessionKey("child", parent_id="parent")
    pref = b.preference(child, ["w1", "w2"])
    # Soft even under hard affinity: the child shares a prefix, not a binding.
    assert (pref.worker_id, pref.only, pref.route) == ("w2", False, common_pb2.SESSION_ROUTE_PARENT)
    assert b.bind(child, "w2", pref) == common_pb2.SESSION_ROUTE_PARENT
    assert b.preference(child, ["w1", "w2"]).route == common_pb2.SESSION_ROUTE_BOUND


def test_bindings_run_out_after_the_ttl_from_the_last_request() -> None:
    b, clock = bindings(ttl_s=60.0)
    b.bind(SessionKey("s"), "w1", b.preference(SessionKey("s"), ["w1"]))
    clock.now += 50
    b.bind(SessionKey("s"), "w1", b.preference(SessionKey("s"), ["w1"]))  # renewed
    clock.now += 50
    assert b.bound("s") == "w1"
    clock.now += 11
    assert b.bound("s") is None
    assert b.preference(SessionKey("s"), ["w1"]).route == common_pb2.SESSION_ROUTE_NEW


def test_another_replicas_binding_is_learned_unless_older_or_past() -> None:
    b, clock = bindings()
    b.learn("s", Binding("w1", clock.now + 30))
    b.learn("s", Binding("w2", clock.now + 10))  # older: kept w1
    assert b.bound("s") == "w1"
    b.learn("s", Binding("w3", clock.now + 40))
    assert b.bound("s") == "w3"
    b.learn("t", Binding("w1", clock.now - 1))
    assert b.bound("t") is None
    b.forget("s", within_s=5)  # renewed since (it runs out in 40 s): not forgotten
    assert b.bound("s") == "w3"
    clock.now += 36
    b.forget("s", within_s=5)  # it ran out, or nearly: forgotten
    assert b.bound("s") is None
    b.learn("s", Binding("w3", clock.now + 40))
    assert b.bound("s") == "w3"
    b.forget("s")
    assert b.bound("s") is None


async def test_a_deleted_key_forgets_a_binding_only_if_it_ran_out_by_the_bindings_clock() -> None:
    b, clock = bindings()
    store = SessionStore(cast(KeyValueStore, None), "ns", b)  # what etcd says is handed in; nothing written
    deleted = WatchEvent(sessions_prefix("ns") + "s", b"", deleted=True)
    b.learn("s", Binding("w1", clock.now + 60))
    store._watched(deleted)  # a binding renewed after the key's last write: kept
    assert b.bound("s") == "w1"
    clock.now += 60 - store.refresh_s
    store._watched(deleted)
    assert b.bound("s") is None


def test_bindings_are_bounded_least_recently_used_first() -> None:
    b, _ = bindings(max_bindings=3)
    for i in range(4):
        b.bind(SessionKey(f"s{i}"), "w", b.preference(SessionKey(f"s{i}"), ["w"]))
    assert len(b) == 3 and b.bound("s0") is None and b.bound("s3") == "w"


def test_off_binds_nothing_and_asks_nothing_kept() -> None:
    b, _ = bindings(Affinity.OFF)
    assert not b.active and b.config.retain_ms == 0
    assert b.preference(SessionKey("s"), ["w1"]).worker_id is None
    assert SessionConfig(ttl_s=12.5).retain_ms == 12_500


@pytest.mark.parametrize("kwargs", [{"ttl_s": 0.0}, {"ttl_s": float("inf")}, {"weight": -1.0},
                                    {"affinity": "sticky"}])
def test_settings_that_cannot_work_name_their_flag(kwargs: dict) -> None:
    with pytest.raises(ConfigError, match="--session-"):
        SessionConfig(**kwargs)


def test_the_etcd_value_round_trips_and_garbage_is_refused() -> None:
    assert decode(encode(Binding("w1", 1234.5))) == Binding("w1", 1234.5)
    assert decode(b"{not json") is None and decode(b'{"worker": "w"}') is None


def _candidate(worker_id: str, waiting: int, usage: float, bonus: float, overlap: int = 0) -> Candidate:
    return Candidate(worker_id, overlap, 0, 100, waiting, usage, session_bonus=bonus)


def test_the_soft_bonus_keeps_a_busier_bound_worker_until_its_load_outweighs_it() -> None:
    weights = CostWeights()
    # Bound worker somewhat busier: it keeps the session.
    kept = [_candidate("bound", 2, 0.5, 1.0), _candidate("idle", 1, 0.2, 0.0)]
    scores = cost_function.logits(kept, 16, 1024, weights)
    assert scores[0] > scores[1]
    # Bound worker overloaded (longest queue, full cache) against an idle one: it moves.
    moved = [_candidate("bound", 30, 1.0, 1.0), _candidate("idle", 0, 0.0, 0.0)]
    scores = cost_function.logits(moved, 16, 1024, weights)
    assert scores[0] < scores[1]


def test_the_dynamo_rule_takes_the_bonus_as_whole_prompts_of_prefill() -> None:
    config = DynamoCostConfig()
    plain = dynamo_cost.costs([_candidate("w", 0, 0.0, 0.0)], 16, 1024, config)[0]
    bound = dynamo_cost.costs([_candidate("w", 0, 0.0, 1.0)], 16, 1024, config)[0]
    assert plain - bound == pytest.approx(config.prefill_load_scale * 1024 / 16)
