"""The router's Prometheus series: decisions, their latency, the share of prompts found cached,
how right its index was about each worker (index_accuracy.py), where LoRA adapters' requests
went (resident or not), and what agent sessions' bindings did (session_bindings.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gen.kvmesh.v1 import common_pb2
from services.routing.explanation import session_route_name

# Adapter names a router labels its series with at most; the routes of any further one count
# under `OTHER_ADAPTERS`. Adapters are only those some worker knows, but workers may be told of
# new ones at run time for ever: this keeps the series bounded all the same.
MAX_ADAPTER_LABELS = 256
OTHER_ADAPTERS = "_other"


class KvTruthMetrics:
    """Whether the router's view of each worker's cache can be trusted, and where it comes from
    (worker_pool.py, kv_event_follower.py, kv_source.py), and how current its view of each
    worker's load is: the load reports it heard, and the requests it sent that they do not count
    yet (its pending ones, which routing adds to the worker's queue). One per registry: a process
    builds it once and gives it to each of its pools."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.event_errors = Counter("kvmesh_router_kv_event_errors", "KV events the index could not apply, per kind",
                                    ["worker_id", "kind"], registry=registry)
        self.resyncs = Counter("kvmesh_router_kv_resyncs", "workers' cached blocks rebuilt from a snapshot",
                               ["worker_id", "reason"], registry=registry)
        self.source = Gauge("kvmesh_router_kv_source", "where the router learns the worker's cache: 0 = its KV events, "
                            "1 = predicted from the prompts routed to it", ["worker_id"], registry=registry)
        self.source_switches = Counter("kvmesh_router_kv_source_switches", "switches of a worker's cache source",
                                       ["worker_id", "source", "reason"], registry=registry)
        self.load_reports = Counter("kvmesh_router_load_reports", "load reports heard from the worker",
                                    ["worker_id"], registry=registry)
        self.pending = Gauge("kvmesh_router_pending_requests", "requests sent to the worker that its load reports "
                             "do not count yet", ["worker_id"], registry=registry)

    def forget(self, worker_id: str) -> None:
        """A worker whose KV events this router no longer follows: its source gauge goes (the KV
        counters stay, as Prometheus counters do)."""
        _remove(self.source, worker_id)

    def forget_load(self, worker_id: str) -> None:
        """A worker that left the pool: its load series go too."""
        for metric in (self.load_reports, self.pending):
            _remove(metric, worker_id)


def _remove(metric: Counter | Gauge, worker_id: str) -> None:
    try:
        metric.remove(worker_id)
    except KeyError:
        pass  # never reported


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decision_seconds = Histogram(
            "kvmesh_router_decision_latency_seconds", "time to pick a worker", registry=registry,
            buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05),
        )
        self.routed = Counter("kvmesh_router_routed_requests", "requests routed, per worker",
                              ["worker_id", "role"], registry=registry)
        self.no_worker = Counter("kvmesh_router_no_worker", "route requests with no eligible worker", registry=registry)
        self.hit_rate = Gauge("kvmesh_router_kv_hit_rate",
                              "share of routed prompt tokens already cached on the chosen worker", registry=registry)
        self.prompt_tokens = Counter("kvmesh_router_prompt_tokens", "prompt tokens routed", registry=registry)
        self.overlap_tokens = Counter("kvmesh_router_overlap_tokens", "routed prompt tokens cached on the chosen worker",
                                      registry=registry)
        self._totals = [0, 0]
        # Per routed request that reported back: predicted against found (index_accuracy.py).
        self.index_accuracy = Histogram(
            "kvmesh_router_index_accuracy_ratio",
            "per routed request, min(predicted, found) / max(predicted, found) of the prompt tokens the worker "
            "reused from its cache (1 when both are 0)", ["worker_id"], registry=registry,
            buckets=(0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0),
        )
        self.index_error = Histogram(
            "kvmesh_router_index_error_tokens",
            "per routed request, |predicted - found| prompt tokens reused from the worker's cache",
            ["worker_id"], registry=registry, buckets=(0, 16, 64, 256, 1024, 4096, 16384),
        )
        self.index_recent_accuracy = Gauge(
            "kvmesh_router_index_recent_accuracy",
            "mean accuracy ratio over the worker's last routed requests (index_accuracy.RECENT_SAMPLES)",
            ["worker_id"], registry=registry,
        )
        self.lora_routes = Counter(
            "kvmesh_router_lora_routes",
            "requests of a LoRA adapter routed, per adapter, and whether the chosen worker held it resident (or was "
            "sent a request of it lately) or had to load it", ["lora_name", "resident"], registry=registry,
        )
        self._adapter_labels: set[str] = set()
        self.session_routes = Counter(
            "kvmesh_router_session_routes",
            "requests of an agent session routed, by what its binding did: new (no binding), bound (to its worker), "
            "moved (that worker outweighed, gone or excluded: bound anew), parent (a sub-agent placed with its "
            "parent's worker preferred)", ["route"], registry=registry,
        )
        self.session_bindings = Gauge("kvmesh_router_session_bindings",
                                      "agent sessions this router knows bound to a worker (its own and other "
                                      "replicas', through etcd)", registry=registry)

    def record_session(self, route: common_pb2.SessionRoute) -> None:
        self.session_routes.labels(session_route_name(route)).inc()

    def record_lora(self, lora_name: str, resident: bool) -> None:
        """A request of adapter `lora_name` routed to a worker that held it resident, or not."""
        if lora_name not in self._adapter_labels:
            if len(self._adapter_labels) >= MAX_ADAPTER_LABELS:
                lora_name = OTHER_ADAPTERS
            else:
                self._adapter_labels.add(lora_name)
        self.lora_routes.labels(lora_name, "true" if resident else "false").inc()

    def record(self, prompt_tokens: int, overlap_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.overlap_tokens.inc(overlap_tokens)
        self._totals[0] += prompt_tokens
        self._totals[1] += overlap_tokens
        self.hit_rate.set(self._totals[1] / self._totals[0] if self._totals[0] else 0.0)

    def record_accuracy(self, worker_id: str, ratio: float, error_tokens: int, recent: float | None) -> None:
        self.index_accuracy.labels(worker_id).observe(ratio)
        self.index_error.labels(worker_id).observe(error_tokens)
        if recent is not None:
            self.index_recent_accuracy.labels(worker_id).set(recent)

    def forget_worker(self, worker_id: str) -> None:
        """The worker left its pool: its accuracy series go with it."""
        for metric in (self.index_accuracy, self.index_error, self.index_recent_accuracy):
            try:
                metric.remove(worker_id)
            except KeyError:
                pass  # it never reported back
