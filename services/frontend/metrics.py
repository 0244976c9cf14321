"""The gateway's Prometheus metrics (its own registry)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.mesh.fast_histogram import FastHistogram
from services.mesh.hop_latency import HopLatency, hop_latency_histogram
from services.mesh.metrics_http import LATENCY_BUCKETS

ITL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class FrontendMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvmesh_frontend_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.inflight = Gauge("kvmesh_frontend_inflight_requests", "requests being served", registry=r)
        # Counted on arrival, admitted or not: the load a planner sizes for, which the requests
        # answered understate while a pool is saturated.
        self.arrived = Counter("kvmesh_frontend_arrived_requests",
                               "generation requests for a served model, counted as they arrive", registry=r)
        self.ttft = Histogram("kvmesh_frontend_time_to_first_token_seconds", "time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        # Observed once per streamed delta: the cheap histogram (fast_histogram.py).
        self.itl = FastHistogram("kvmesh_frontend_inter_token_latency_seconds", "time between streamed deltas",
                                 ITL_BUCKETS, r)
        # Output tokens answered (counted when a request ends): throughput in tokens, whatever
        # number of tokens each streamed delta carried.
        self.completion_tokens = Counter("kvmesh_frontend_completion_tokens", "output tokens answered", registry=r)
        # Prompt tokens of answered requests: with the two counters the planner knows the mix.
        self.prompt_tokens = Counter("kvmesh_frontend_prompt_tokens", "prompt tokens of answered requests", registry=r)
        self.duration = Histogram("kvmesh_frontend_request_duration_seconds", "request duration",
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.hop = HopLatency(hop_latency_histogram(r), "frontend")
        # Overload refusals answered from the gateway's memory of the mesh's last one (a count
        # read from the gateway: refusal_memory.py).
        self.refused_from_memory = Gauge("kvmesh_frontend_refused_from_memory_total",
                                         "overload refusals the gateway answered itself, repeating the mesh's last "
                                         "refusal of the same kind of request", registry=r)
        # Fields agent clients send that the gateway takes without effect (client_fields.py).
        self.client_fields = Counter("kvmesh_frontend_client_fields", "request fields taken without effect on the "
                                     "answer, by API, field and effect (accepted or unknown)",
                                     ["api", "field", "effect"], registry=r)
