"""Each worker's engine load as Prometheus gauges, read at scrape time and labelled by worker id."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
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

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["worker_id", "role"]
        families = {
            name: GaugeMetricFamily(f"kvmesh_{name}", f"worker load: {name}", labels=labels)
            for name in LOAD_FIELDS
        }
        host_active = GaugeMetricFamily("kvmesh_host_kv_active_blocks", "blocks held in the host-memory KV tier",
                                        labels=labels)
        host_total = GaugeMetricFamily("kvmesh_host_kv_total_blocks", "capacity of the host-memory KV tier, blocks",
                                       labels=labels)
        host_hits = CounterMetricFamily("kvmesh_worker_host_hits", "prompt blocks loaded back from the host-memory "
                                        "KV tier instead of recomputed", labels=labels)
        for worker_id, role, load in self._sources():
            for name in LOAD_FIELDS:
                families[name].add_metric([worker_id, role], float(getattr(load, name)))
            if (host := load.host_tier) is not None:
                host_active.add_metric([worker_id, role], host.active_blocks)
                host_total.add_metric([worker_id, role], host.total_blocks)
                host_hits.add_metric([worker_id, role], host.hit_blocks_total)
        yield from families.values()
        yield from (host_active, host_total, host_hits)
