"""The gateway's moment of memory of the mesh's overload refusals."""

from __future__ import annotations

import time

from services.frontend.errors import ApiError
from services.frontend.refusal_memory import MAX_KINDS, RefusalMemory

HEAVY = ("m", "heavy", 0, 0)


def overloaded(retry_ms: int = 800) -> ApiError:
    return ApiError(429, "predicted time to first token 1.4s exceeds the objective", code="overloaded",
                    retry_after_ms=retry_ms)


def test_a_refusal_is_repeated_for_the_same_kind_for_a_moment_only() -> None:
    memory = RefusalMemory(memory_s=0.05)
    assert memory.recall(HEAVY) is None
    memory.remember(HEAVY, overloaded())
    again = memory.recall(HEAVY)
    assert again is not None and (again.status, again.code) == (429, "overloaded")
    assert 1 <= again.retry_after_ms <= 800 and memory.answered == 1
    # Another tenant, band or objective goes to the mesh.
    for other in (("m", "light", 0, 0), ("m", "heavy", -1, 0), ("m", "heavy", 0, 5000), ("n", "heavy", 0, 0)):
        assert memory.recall(other) is None
    time.sleep(0.06)
    assert memory.recall(HEAVY) is None and memory.answered == 1


def test_only_the_meshs_timed_refusals_are_remembered_and_never_longer_than_they_said() -> None:
    memory = RefusalMemory(memory_s=10.0)
    memory.remember(HEAVY, ApiError(429, "the gateway is at its concurrency limit", code="overloaded"))
    memory.remember(("m", "x", 0, 0), ApiError(503, "no worker", code="unavailable", retry_after_ms=1000))
    memory.remember(("m", "y", 0, 0), ApiError(400, "bad", code="invalid_request"))
    assert memory.recall(HEAVY) is None and memory.recall(("m", "x", 0, 0)) is None
    memory.remember(HEAVY, overloaded(retry_ms=30))
    time.sleep(0.04)
    assert memory.recall(HEAVY) is None  # its own Retry-After was shorter than the memory


def test_the_memory_is_bounded() -> None:
    memory = RefusalMemory(memory_s=10.0)
    for i in range(MAX_KINDS + 10):
        memory.remember(("m", f"t{i}", 0, 0), overloaded())
    assert len(memory._kinds) <= MAX_KINDS  # noqa: SLF001 - the bound is the point of this test
    assert memory.recall(("m", f"t{MAX_KINDS + 9}", 0, 0)) is not None
