"""GcPauses times every collection by generation while installed, and nothing after removal."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry

from services.mesh.gc_pauses import GcPauses


def counts(registry: CollectorRegistry) -> dict[str, float]:
    return {s.labels["generation"]: s.value for s in registry.collect().__next__().samples
            if s.name == "kvmesh_gc_pause_seconds_count"}


def test_collections_are_timed_by_generation_while_installed() -> None:
    registry = CollectorRegistry()
    pauses = GcPauses(registry)
    pauses.install()
    try:
        gc.collect(2)
        gc.collect(0)
        timed = counts(registry)
    finally:
        pauses.remove()
    assert timed["2"] >= 1 and timed["0"] >= 1
    gc.collect(2)
    assert counts(registry)["2"] == timed["2"]  # removed: no longer timed
    pauses.remove()  # twice is harmless (teardown after a failed start)
