"""The gateway's moment of memory of the mesh's overload refusals."""

from __future__ import annotations

from services.frontend.errors import ApiError
from services.frontend.refusal_memory import MAX_KINDS, RefusalMemory
from tests.unit.clocks import FakeClock

HEAVY = ("m", "heavy", 0, 0)


def overloaded(retry_ms: int = 800) -> ApiError:
    return ApiError(429, "predicted time to first token 1.4s exceeds the objective", code="overloaded",
                    retry_after_ms=retry_ms)


def test_a_refusal_is_repeated_for_the_same_kind_for_a_moment_only() -> None:
    clock = FakeClock()
    memory = RefusalMemory(memory_s=0.05, clock=clock)
    assert memory.recall(HEAVY) is None
    memory.remember(HEAVY, overloaded())
    clock.advance(0.01)
    again = memory.recall(HEAVY)
    assert again is not None and (again.status, again.code) == (429, "overloaded")
    assert again.retry_after_ms == 790 and memory.answered == 1  # its Retry-After counted down
    # Another tenant, band or objective goes to the mesh.
    for other in (("m", "light", 0, 0), ("m", "heavy", -1, 0), ("m", "heavy", 0, 5000), ("n", "heavy", 0, 0)):
        assert memory.recall(other) is None
    clock.advance(0.039)
    assert memory.recall(HEAVY) is not None and memory.answered == 2  # still within the moment
    clock.advance(0.002)
    assert memory.recall(HEAVY) is None and memory.answered == 2


def test_only_the_meshs_timed_refusals_are_remembered_and_never_longer_than_they_said() -> None:
    clock = FakeClock()
    memory = RefusalMemory(memory_s=10.0, clock=clock)
    memory.remember(HEAVY, ApiError(429, "the gateway is at its concurrency limit", code="overloaded"))
    memory.remember(("m", "x", 0, 0), ApiError(503, "no worker", code="unavailable", retry_after_ms=1000))
    memory.remember(("m", "y", 0, 0), ApiError(400, "bad", code="invalid_request"))
    assert memory.recall(HEAVY) is None and memory.recall(("m", "x", 0, 0)) is None
    memory.remember(HEAVY, overloaded(retry_ms=30))
    clock.advance(0.029)
    recalled = memory.recall(HEAVY)
    assert recalled is not None and recalled.retry_after_ms == 1
    clock.advance(0.002)
    assert memory.recall(HEAVY) is None  # its own Retry-After was shorter than the memory


def test_the_memory_is_bounded() -> None:
    memory = RefusalMemory(memory_s=10.0)
    for i in range(MAX_KINDS + 10):
        memory.remember(("m", f"t{i}", 0, 0), overloaded())
    assert len(memory._kinds) <= MAX_KINDS  # noqa: SLF001 - the bound is the point of this test
    assert memory.recall(("m", f"t{MAX_KINDS + 9}", 0, 0)) is not None
