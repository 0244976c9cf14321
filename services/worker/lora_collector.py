"""Each worker's LoRA adapters as Prometheus metrics, read at scrape time from the engine's
`AdapterSet`, labelled by worker id, role and adapter.

Counters never reset: an adapter unloaded (or forgotten) keeps its series, `resident` 0. Read on
the metrics server's thread, so only by single steps over the set's dicts (a copy of `stats`, one
membership test each), never by iterating one the event loop may change meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.engines.lora import AdapterSet

LABELS = ["worker_id", "role", "lora_name"]


class WorkerLoraCollector(Collector):
    def __init__(self, sources: Callable[[], Iterable[tuple[str, str, AdapterSet]]]) -> None:
        self._sources = sources

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        requests = CounterMetricFamily("kvmesh_worker_lora_requests", "requests run with the LoRA adapter",
                                       labels=LABELS)
        loads = CounterMetricFamily("kvmesh_worker_lora_loads", "loads of the LoRA adapter into the engine",
                                    labels=LABELS)
        unloads = CounterMetricFamily("kvmesh_worker_lora_unloads", "unloads of the LoRA adapter (evicted for "
                                      "another, or forgotten)", labels=LABELS)
        load_seconds = CounterMetricFamily("kvmesh_worker_lora_load_seconds", "time spent loading the LoRA adapter",
                                           labels=LABELS)
        resident = GaugeMetricFamily("kvmesh_worker_lora_resident", "1 while the LoRA adapter is loaded in the engine",
                                     labels=LABELS)
        max_loras = GaugeMetricFamily("kvmesh_worker_max_loras", "LoRA adapters the engine keeps loaded at once",
                                      labels=LABELS[:2])
        for worker_id, role, adapters in self._sources():
            max_loras.add_metric([worker_id, role], adapters.config.max_loras)
            for name, stats in list(adapters.stats.items()):
                labels = [worker_id, role, name]
                requests.add_metric(labels, stats.requests)
                loads.add_metric(labels, stats.loads)
                unloads.add_metric(labels, stats.unloads)
                load_seconds.add_metric(labels, stats.load_seconds)
                resident.add_metric(labels, 1.0 if adapters.is_resident(name) else 0.0)
        yield from (requests, loads, unloads, load_seconds, resident, max_loras)
