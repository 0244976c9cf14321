"""FastHistogram exposes exactly what prometheus_client's Histogram does for the same
observations (the reference model): same buckets, counts and sums, with and without labels,
values on the bucket bounds included."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client import generate_latest

from services.mesh.fast_histogram import FastHistogram
from testkit.metrics import parse

BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.1, 1.0)


def exposed(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in parse(generate_latest(registry).decode())
            if not s.name.endswith("_created")}


@pytest.mark.parametrize("labelnames", [(), ("hop",)])
def test_exposes_what_prometheus_clients_histogram_exposes(labelnames: tuple[str, ...]) -> None:
    rng = random.Random(7)
    reference_registry, fast_registry = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("kvmesh_test_seconds", "a test", labelnames, buckets=BUCKETS, registry=reference_registry)
    fast = FastHistogram("kvmesh_test_seconds", "a test", BUCKETS, fast_registry, labelnames)
    if not labelnames:
        assert exposed(fast_registry) == exposed(reference_registry)  # zeros before any observation
    values = [rng.choice(BUCKETS) for _ in range(50)] + [rng.expovariate(50) for _ in range(500)] + [3.0, 0.0]
    for i, value in enumerate(values):
        label = ("worker", "processor")[i % 2]
        (reference.labels(label) if labelnames else reference).observe(value)
        (fast.labels(label) if labelnames else fast).observe(value)
    got, want = exposed(fast_registry), exposed(reference_registry)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key


def test_labels_must_match_the_declared_names() -> None:
    fast = FastHistogram("kvmesh_test_seconds", "a test", BUCKETS, CollectorRegistry(), ("hop",))
    with pytest.raises(ValueError, match="takes labels"):
        fast.labels()
