"""Each worker's engine load as Prometheus gauges, read at scrape time and labelled by worker id."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.engines.base import LoadSnapshot, SessionPinLoad

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
        sessions = _SessionFamilies(labels)
        images = {name: CounterMetricFamily(f"kvmesh_worker_{name}", text, labels=labels) for name, text in (
            ("images_encoded", "images the engine's encoder encoded"),
            ("image_encoder_cache_hits", "images whose features the engine kept from an earlier request"),
            ("image_kv_hits", "images needing no encoding: their tokens were in cached KV blocks"),
            ("image_features_taken", "images whose features were pulled from an encode worker"))}
        for worker_id, role, load in self._sources():
            for name in LOAD_FIELDS:
                families[name].add_metric([worker_id, role], float(getattr(load, name)))
            if (host := load.host_tier) is not None:
                host_active.add_metric([worker_id, role], host.active_blocks)
                host_total.add_metric([worker_id, role], host.total_blocks)
                host_hits.add_metric([worker_id, role], host.hit_blocks_total)
            if load.sessions is not None:
                sessions.add([worker_id, role], load.sessions)
            if (image := load.images) is not None:
                images["images_encoded"].add_metric([worker_id, role], image.encoded_total)
                images["image_encoder_cache_hits"].add_metric([worker_id, role], image.encoder_cache_hits_total)
                images["image_kv_hits"].add_metric([worker_id, role], image.kv_hits_total)
                images["image_features_taken"].add_metric([worker_id, role], image.taken_total)
        yield from families.values()
        yield from images.values()
        yield from (host_active, host_total, host_hits)
        yield from sessions.families()


class _SessionFamilies:
    """Agent sessions' retained KV (SessionPinLoad), for engines that keep it (the mocker)."""

    def __init__(self, labels: list[str]) -> None:
        self.pins = GaugeMetricFamily("kvmesh_worker_session_pins", "agent sessions whose KV the worker keeps "
                                      "between their requests", labels=labels)
        self.device = GaugeMetricFamily("kvmesh_worker_session_pinned_blocks", "device KV blocks pinned for idle "
                                        "agent sessions", labels=labels)
        self.budget = GaugeMetricFamily("kvmesh_worker_session_pin_budget_blocks", "device KV blocks sessions may "
                                        "keep pinned (--session-pin-blocks)", labels=labels)
        self.host = GaugeMetricFamily("kvmesh_worker_session_host_blocks", "host-tier KV blocks protected from its "
                                      "LRU drop for idle agent sessions", labels=labels)
        self.prefetched = CounterMetricFamily("kvmesh_worker_session_prefetched_blocks", "session KV blocks loaded "
                                              "back from the host tier as the session's request arrived",
                                              labels=labels)
        self.demoted = CounterMetricFamily("kvmesh_worker_session_demoted_blocks", "pinned device blocks released "
                                           "past the pin budget or for running requests (kept in the host tier "
                                           "when there is one)", labels=labels)

    def add(self, labels: list[str], load: SessionPinLoad) -> None:
        self.pins.add_metric(labels, load.pins)
        self.device.add_metric(labels, load.device_blocks)
        self.budget.add_metric(labels, load.device_budget)
        self.host.add_metric(labels, load.host_blocks)
        self.prefetched.add_metric(labels, load.prefetched_blocks_total)
        self.demoted.add_metric(labels, load.demoted_blocks_total)

    def families(self) -> tuple[GaugeMetricFamily | CounterMetricFamily, ...]:
        return self.pins, self.device, self.budget, self.host, self.prefetched, self.demoted
