"""Each worker's engine load as Prometheus gauges, read at scrape time and labelled by worker id."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.engines.base import LoadSnapshot

# The load fields every worker reports (the router's cost function reads the same ones).
LOAD_FIELDS = (
    "request_active_slots",
    "request_total_slots",
    "kv_active_blocks",
    "kv_total_blocks",
    "num_requests_waiting",
    "gpu_cache_usage_perc",
    "gpu_prefix_cache_hit_rate",
)


class WorkerLoadCollector(Collector):
    def __init__(self, sources: Callable[[], Iterable[tuple[str, str, LoadSnapshot]]]) -> None:
        self._sources = sources

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = {
            name: GaugeMetricFamily(f"kvmesh_{name}", f"worker load: {name}", labels=["worker_id", "role"])
            for name in LOAD_FIELDS
        }
        for worker_id, role, load in self._sources():
            for name in LOAD_FIELDS:
                families[name].add_metric([worker_id, role], float(getattr(load, name)))
        yield from families.values()
