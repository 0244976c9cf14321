"""Prometheus exposition for the mesh's processes (each with its own registry, no globals)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.engines.base import LoadSnapshot

LOAD_FIELDS = (
    "request_active_slots",
    "request_total_slots",
    "kv_active_blocks",
    "kv_total_blocks",
    "num_requests_waiting",
    "gpu_cache_usage_perc",
    "gpu_prefix_cache_hit_rate",
)

# Latency buckets from 1 ms to 60 s: TTFT on the mocker is sub-ms, on a long prompt seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class WorkerLoadCollector(Collector):
    """Reads each worker's engine load at scrape time, labelled by worker id."""

    def __init__(self, sources: Callable[[], Iterable[tuple[str, str, LoadSnapshot]]]) -> None:
        self._sources = sources

    def collect(self):
        families = {
            name: GaugeMetricFamily(f"kvmesh_{name}", f"worker load: {name}", labels=["worker_id", "role"])
            for name in LOAD_FIELDS
        }
        for worker_id, role, load in self._sources():
            for name in LOAD_FIELDS:
                families[name].add_metric([worker_id, role], float(getattr(load, name)))
        yield from families.values()


def serve_metrics(registry: CollectorRegistry, host: str, port: int = 0) -> int:
    """Serves /metrics on a background thread; returns the bound port."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)
