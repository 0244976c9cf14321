"""The router's admission metrics: per tenant (admitted, refused by reason, queue wait) and the
queue as a whole (depth and the wait a request arriving now is predicted, which the planner reads).

Tenant names come from API keys' tenants or a header a client may set, so at most
`MAX_TENANT_LABELS` distinct names become labels; the rest are counted as "other".
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gen.kvmesh.v1 import common_pb2

MAX_TENANT_LABELS = 64
OTHER_TENANTS = "other"
# The reason label of a refusal: the Overload enum's name without its prefix, lower case.
REASONS = {v: common_pb2.Overload.Name(v).removeprefix("OVERLOAD_").lower() for v in common_pb2.Overload.values()}


class AdmissionMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._admitted = Counter("kvmesh_admission_admitted", "requests admitted to the decode pool, per tenant",
                                 ["tenant"], registry=registry)
        self._refused = Counter("kvmesh_admission_refused", "requests refused at admission, per tenant and reason",
                                ["tenant", "reason"], registry=registry)
        self._wait = Histogram("kvmesh_admission_queue_wait_seconds", "time admitted requests waited for a worker",
                               ["tenant"], registry=registry,
                               buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30))
        self._labels: set[str] = set()

    def follow(self, queued: Callable[[], float], predicted_wait_now: Callable[[], float],
               policy_reloads: Callable[[], float], policy_errors: Callable[[], float]) -> None:
        """Gauges read from the admission (gate.py) at scrape time (one pool's per registry)."""
        Gauge("kvmesh_admission_queued", "requests waiting for a decode worker", registry=self._registry
              ).set_function(queued)
        Gauge("kvmesh_admission_predicted_wait_seconds",
              "queue wait predicted now for a request of priority 0 of the default tenant (the first model served)",
              registry=self._registry).set_function(predicted_wait_now)
        Gauge("kvmesh_tenant_policy_reloads", "times the tenant policy file was read again after a change",
              registry=self._registry).set_function(policy_reloads)
        Gauge("kvmesh_tenant_policy_errors", "changes of the tenant policy file that did not validate (kept the old)",
              registry=self._registry).set_function(policy_errors)

    def _label(self, tenant: str) -> str:
        if tenant in self._labels:
            return tenant
        if len(self._labels) < MAX_TENANT_LABELS:
            self._labels.add(tenant)
            return tenant
        return OTHER_TENANTS

    def admitted(self, tenant: str, waited_s: float) -> None:
        label = self._label(tenant)
        self._admitted.labels(label).inc()
        self._wait.labels(label).observe(waited_s)

    def refused(self, tenant: str, overload: common_pb2.Overload) -> None:
        self._refused.labels(self._label(tenant), REASONS.get(overload, "unspecified")).inc()
