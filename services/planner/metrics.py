"""The planner's Prometheus metrics: every decision's inputs and outcome (`kvmesh_planner_*`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from services.planner.model import Scales, Traffic
from services.planner.policy import Decision
from services.planner.pools import ROLES, SIZED_ROLES, PoolSizes


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry, sizes_encode: bool = False) -> None:
        """`sizes_encode`: the planner sizes the encode pool (its role's series exported)."""
        r = registry
        self._roles = SIZED_ROLES if sizes_encode else ROLES
        self.desired = Gauge("kvmesh_planner_desired_workers", "workers per role the last plan asks for", ["role"],
                             registry=r)
        self.actual = Gauge("kvmesh_planner_actual_workers", "workers per role registered in etcd", ["role"],
                            registry=r)
        self.predicted_ttft = Gauge("kvmesh_planner_predicted_ttft_seconds", "TTFT predicted at the planned sizes",
                                    registry=r)
        self.predicted_itl = Gauge("kvmesh_planner_predicted_itl_seconds", "ITL predicted at the planned sizes",
                                   registry=r)
        self.observed_ttft = Gauge("kvmesh_planner_observed_ttft_seconds", "mean TTFT over the last interval",
                                   registry=r)
        self.observed_itl = Gauge("kvmesh_planner_observed_itl_seconds", "mean ITL over the last interval",
                                  registry=r)
        self.rate = Gauge("kvmesh_planner_request_rate", "answered requests per second over the last interval",
                          registry=r)
        self.input_tokens = Gauge("kvmesh_planner_mean_input_tokens", "mean prompt length over the last interval",
                                  registry=r)
        self.output_tokens = Gauge("kvmesh_planner_mean_output_tokens", "mean output length over the last interval",
                                   registry=r)
        self.scale = Gauge("kvmesh_planner_profile_scale",
                           "how much slower than its profile a pool turned out (its costs are multiplied by this)",
                           ["role"], registry=r)
        self.remote_share = Gauge("kvmesh_planner_remote_prefill_share",
                                  "share of requests prefilled on the prefill pool over the last interval", registry=r)
        self.decisions = Counter("kvmesh_planner_decisions", "plans made", registry=r)
        self.switches = Counter("kvmesh_planner_switches", "workers moved to the other role", registry=r)
        self.scale_events = Counter("kvmesh_planner_scale_events", "workers started or stopped, by role",
                                    ["role", "direction"], registry=r)
        self.encode_rate = Gauge("kvmesh_planner_encode_rate", "images per second asked of the encode pool over "
                                 "the last interval (when the planner sizes it)", registry=r)
        self.encode_service = Gauge("kvmesh_planner_encode_seconds", "encode workers' busy seconds per image over the "
                                    "last interval (when measured)", registry=r)
        self.connector_errors = Counter("kvmesh_planner_connector_errors", "plans the connector could not carry out",
                                        registry=r)

    def record(self, registered: PoolSizes, traffic: Traffic, scales: Scales, decision: Decision) -> None:
        self.decisions.inc()
        for role in self._roles:
            self.desired.labels(role).set(decision.desired.of(role))
            self.actual.labels(role).set(registered.of(role))
        self.encode_rate.set(traffic.encode.rate_per_s)
        if traffic.encode.service_s is not None:
            self.encode_service.set(traffic.encode.service_s)
        self.predicted_ttft.set(decision.predicted_ttft_s)  # +Inf: the pool would be saturated
        self.predicted_itl.set(decision.predicted_itl_s)
        self.observed_ttft.set(traffic.observed_ttft_s or 0.0)
        self.observed_itl.set(traffic.observed_itl_s or 0.0)
        self.rate.set(traffic.rate_per_s)
        self.input_tokens.set(traffic.mean_input_tokens)
        self.output_tokens.set(traffic.mean_output_tokens)
        self.scale.labels("prefill").set(scales.prefill)
        self.scale.labels("decode").set(scales.decode)
        if traffic.remote_share is not None:
            self.remote_share.set(traffic.remote_share)

    def applied(self, current: PoolSizes, desired: PoolSizes, switched: int) -> None:
        """Counts a carried-out plan: `switched` workers changed role, the rest started or stopped."""
        self.switches.inc(switched)
        for role in self._roles:
            change = desired.of(role) - current.of(role)
            # Only prefill and decode workers switch roles; the encode pool is started and stopped.
            moved_in = 0 if role not in ROLES else switched if change > 0 else -switched if change < 0 else 0
            started = change - moved_in
            if started:
                self.scale_events.labels(role, "up" if started > 0 else "down").inc(abs(started))

