"""The admission queue's order as tables: bands strictly, weighted fair shares across tenants
inside a band, earliest deadline first inside a tenant."""

from __future__ import annotations

import pytest

from services.routing.admission.fair_queue import FairQueue


def drain(queue: FairQueue[str]) -> list[str]:
    out = []
    while (entry := queue.pop()) is not None:
        out.append(entry.item)
    return out


def queue_of(weights: dict[str, float] | None = None) -> FairQueue[str]:
    return FairQueue(lambda tenant: (weights or {}).get(tenant, 1.0))


@pytest.mark.parametrize(("pushes", "order"), [
    # (item, band, tenant, deadline): a lower band always first, whatever was queued before.
    ([("a1", 0, "a", 1), ("h1", -1, "a", 9), ("a2", 0, "a", 2), ("h2", -1, "b", 9)], ["h1", "h2", "a1", "a2"]),
    # Inside one tenant: the earliest deadline, then arrival order.
    ([("late", 0, "a", 5), ("soon", 0, "a", 1), ("tie1", 0, "a", 3), ("tie2", 0, "a", 3)],
     ["soon", "tie1", "tie2", "late"]),
    # Two tenants of equal weight take turns, whoever queued more.
    ([("a1", 0, "a", 1), ("a2", 0, "a", 2), ("a3", 0, "a", 3), ("b1", 0, "b", 4), ("b2", 0, "b", 5)],
     ["a1", "b1", "a2", "b2", "a3"]),
], ids=["bands", "deadlines", "turns"])
def test_order(pushes: list[tuple[str, int, str, float]], order: list[str]) -> None:
    queue = queue_of()
    for item, band, tenant, deadline in pushes:
        queue.push(item, band, tenant, deadline)
    assert drain(queue) == order


@pytest.mark.parametrize(("weights", "share_a"), [({"a": 1, "b": 1}, 0.5), ({"a": 3, "b": 1}, 0.75),
                                                  ({"a": 1, "b": 4}, 0.2)])
def test_backlogged_tenants_are_served_in_proportion_to_their_weights(weights: dict[str, float],
                                                                      share_a: float) -> None:
    queue = queue_of(weights)
    for i in range(400):
        queue.push(f"a{i}", 0, "a", i)
        queue.push(f"b{i}", 0, "b", i)
    first = [queue.pop() for _ in range(200)]
    assert sum(e is not None and e.tenant == "a" for e in first) == pytest.approx(200 * share_a, abs=1)


def test_a_light_tenant_waits_behind_about_one_request_of_a_heavy_one() -> None:
    queue = queue_of()
    for i in range(100):
        queue.push(f"heavy{i}", 0, "heavy", i)
    for _ in range(10):  # the heavy tenant has been served a while
        queue.pop()
    queue.push("light", 0, "light", 1000)
    assert [queue.pop().item for _ in range(2)].index("light") <= 1  # type: ignore[union-attr]


def test_an_idle_tenant_earns_no_credit_to_spend_in_a_burst() -> None:
    queue = queue_of()
    for i in range(50):
        queue.push(f"a{i}", 0, "a", i)
    for _ in range(40):
        queue.pop()
    for i in range(10):  # b was idle all along: it starts at the band's virtual time
        queue.push(f"b{i}", 0, "b", i)
    served = [queue.pop().tenant for _ in range(10)]  # type: ignore[union-attr]
    assert served.count("b") == 5


def test_removed_entries_are_skipped_and_forgotten() -> None:
    queue = queue_of()
    entries = [queue.push(f"a{i}", 0, "a", i) for i in range(5)]
    b = queue.push("b0", 1, "b", 0)
    queue.remove(entries[0])
    queue.remove(entries[3])
    queue.remove(entries[3])  # twice: no effect
    queue.remove(b)
    assert len(queue) == 3
    assert queue.bands() == {0: 3}
    assert drain(queue) == ["a1", "a2", "a4"]
    assert len(queue) == 0 and queue.bands() == {}
    assert queue.pop() is None


def test_the_structure_does_not_grow_with_every_tenant_ever_seen() -> None:
    queue = queue_of()
    for i in range(1000):
        queue.push(f"x{i}", 0, f"tenant{i}", i)
        queue.pop()
    assert not queue._bands  # noqa: SLF001 - the bound is the point of this test


@pytest.mark.parametrize(("waiting", "band", "tenant", "ahead"), [
    # Empty: nobody ahead.
    ({}, 0, "a", 0),
    # Every request of a lower band is ahead; none of a higher one.
    ({(-1, "x"): 5, (1, "y"): 7}, 0, "a", 5),
    # Its own, plus each other tenant's share of the same number of rounds (at most all of it).
    ({(0, "a"): 3, (0, "b"): 10, (0, "c"): 1}, 0, "a", 3 + 4 + 1),
    # A tenant with nothing queued is served next: about one of each other backlogged tenant.
    ({(0, "b"): 10, (0, "c"): 10}, 0, "a", 2),
], ids=["empty", "bands", "shares", "light"])
def test_ahead_of_estimates_the_fair_position(waiting: dict[tuple[int, str], int], band: int, tenant: str,
                                              ahead: int) -> None:
    queue = queue_of()
    for (b, t), n in waiting.items():
        for i in range(n):
            queue.push(f"{t}{i}", b, t, i)
    assert queue.ahead_of(band, tenant) == ahead
    assert queue.waiting(band, tenant) == waiting.get((band, tenant), 0)
