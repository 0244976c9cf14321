"""Garbage-collector pauses as a metric: `kvmesh_gc_pause_seconds{generation}`.

A collection stops the whole process, event loop included, for as long as it walks its
generation's objects: a pause in the middle of a stream is a gap in every stream the process
carries, which the per-hop latency shows but cannot explain. Start-up objects are frozen out of
collections (service_runner.freeze_start_up_objects); this shows what the rest still costs.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from prometheus_client import CollectorRegistry

from services.mesh.fast_histogram import FastHistogram

# From 10 µs (a young generation) to 1 s (a full collection over a large heap).
GC_BUCKETS = (0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class GcPauses:
    """Times every collection of this process into the registry's histogram, once installed.
    Collections never overlap (the collector holds the interpreter), so one start time does."""

    def __init__(self, registry: CollectorRegistry) -> None:
        histogram = FastHistogram("kvmesh_gc_pause_seconds", "how long each garbage collection stopped the process",
                                  GC_BUCKETS, registry, ["generation"])
        self._observers = [histogram.labels(str(generation)).observe for generation in range(3)]
        self._started = 0.0

    def install(self) -> None:
        gc.callbacks.append(self._on_collection)

    def remove(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._observers[min(int(info["generation"]), 2)](time.perf_counter() - self._started)
