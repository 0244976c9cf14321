"""The router's Prometheus series: decisions, their latency, and the share of prompts found cached."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


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

    def record(self, prompt_tokens: int, overlap_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.overlap_tokens.inc(overlap_tokens)
        self._totals[0] += prompt_tokens
        self._totals[1] += overlap_tokens
        self.hit_rate.set(self._totals[1] / self._totals[0] if self._totals[0] else 0.0)
