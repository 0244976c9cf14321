"""The planner's loop: every interval, measure, decide, log, export, and carry the plan out.

One adjustment reads the traffic since the last one (traffic.py), the pools as registered in
etcd, and the pools the connector controls; the policy decides (policy.py); the decision is
logged as one line with its inputs and exported; a plan that differs from the pools goes to the
connector, with a deadline. A connector that fails is logged and counted, and the next
adjustment plans again from what is then registered: nothing is retried blindly.
"""

from __future__ import annotations

import asyncio
import logging
import time

from services.mesh.discovery import ComponentView
from services.planner.connectors.base import Connector, ConnectorError
from services.planner.encode_pool import EncodeTraffic
from services.planner.metrics import PlannerMetrics
from services.planner.policy import Decision, Policy
from services.planner.pools import PoolSizes
from services.planner.traffic import MeshTraffic

log = logging.getLogger(__name__)

# A switch waits for the worker's work in flight (up to its drain timeout) and a start for a
# worker to register: the connector gets this long before the adjustment gives up on it.
APPLY_TIMEOUT_S = 120.0


class Planner:
    def __init__(self, policy: Policy, traffic: MeshTraffic, prefill: ComponentView, decode: ComponentView,
                 connector: Connector, metrics: PlannerMetrics, interval_s: float,
                 encode: ComponentView | None = None) -> None:
        """`encode`: the encode pool's view, when the planner sizes it."""
        self.policy, self.traffic, self.connector, self.metrics = policy, traffic, connector, metrics
        self._prefill, self._decode, self._encode = prefill, decode, encode
        self.interval_s = interval_s
        self.last: Decision | None = None

    def registered(self) -> PoolSizes:
        return PoolSizes(len(self._prefill.instances), len(self._decode.instances),
                         0 if self._encode is None else len(self._encode.instances))

    async def run(self) -> None:
        await self.traffic.sample(time.monotonic())  # the baseline the first interval is measured from
        while True:
            await asyncio.sleep(self.interval_s)
            await self.adjust()

    async def adjust(self) -> Decision:
        now = time.monotonic()
        traffic = await self.traffic.sample(now)
        registered = self.registered()
        try:
            controlled = await asyncio.wait_for(self.connector.current(), APPLY_TIMEOUT_S)
        except (ConnectorError, TimeoutError) as exc:
            self.metrics.connector_errors.inc()
            log.warning("the %s connector could not read the pools: %s", self.connector.name, exc or "timed out")
            controlled = None
        current = controlled or registered
        decision = self.policy.decide(now, current, traffic, measured=registered)
        self.last = decision
        scales = self.policy.calibration.scales
        self.metrics.record(registered, traffic, scales, decision)
        hindsight = decision.hindsight
        log.info("plan %s -> %s (%s): %.2f req/s, mean in %.0f / out %.0f tokens, remote prefill %s, "
                 "TTFT %s ITL %s observed, %s / %s modelled, %.3fs / %.4fs predicted, profile scales %.2f / %.2f, "
                 "registered %s%s", current, decision.desired, decision.reason, traffic.rate_per_s,
                 traffic.mean_input_tokens, traffic.mean_output_tokens, _share(traffic.remote_share),
                 _seconds(traffic.observed_ttft_s), _seconds(traffic.observed_itl_s),
                 _seconds(hindsight.ttft_s if hindsight else None), _seconds(hindsight.itl_s if hindsight else None),
                 decision.predicted_ttft_s, decision.predicted_itl_s, scales.prefill, scales.decode, registered,
                 _encoding(traffic.encode) if self._encode is not None else "")
        if decision.desired != current:
            await self._carry_out(current, decision.desired)
        return decision

    async def _carry_out(self, current: PoolSizes, desired: PoolSizes) -> None:
        try:
            switched = await asyncio.wait_for(self.connector.apply(current, desired), APPLY_TIMEOUT_S)
        except (ConnectorError, TimeoutError) as exc:
            self.metrics.connector_errors.inc()
            log.warning("the %s connector could not move the pools from %s to %s: %s", self.connector.name,
                        current, desired, exc or "timed out")
            return
        if self.connector.acts:
            self.metrics.applied(current, desired, switched)


def _encoding(encode: EncodeTraffic) -> str:
    return f", images {encode.rate_per_s:.2f}/s at {_seconds(encode.service_s)} each"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"
