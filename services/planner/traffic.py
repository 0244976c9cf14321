"""What the planner knows of the traffic: the frontends' own Prometheus metrics, scraped.

Every frontend registers the port its /metrics is on. Each interval the planner reads the
cumulative counters and histogram sums of all of them and turns the difference since the last
reading into a `Traffic`: arrival rate (answered requests per second), mean prompt and output
length, mean TTFT and ITL. A frontend that appears starts from its first reading; one that
restarted (counters went down) is read from zero again, so a restart never shows a negative rate.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.mesh.discovery import ComponentView
from services.planner.model import Traffic

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 2.0
# Sample name -> field of `Counters`.
_SAMPLES = {
    "kvmesh_frontend_request_duration_seconds_count": "requests",
    "kvmesh_frontend_prompt_tokens_total": "prompt_tokens",
    "kvmesh_frontend_completion_tokens_total": "completion_tokens",
    "kvmesh_frontend_time_to_first_token_seconds_sum": "ttft_sum",
    "kvmesh_frontend_time_to_first_token_seconds_count": "ttft_count",
    "kvmesh_frontend_inter_token_latency_seconds_sum": "itl_sum",
    "kvmesh_frontend_inter_token_latency_seconds_count": "itl_count",
}


@dataclass
class Counters:
    requests: float = 0.0
    prompt_tokens: float = 0.0
    completion_tokens: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    itl_sum: float = 0.0
    itl_count: float = 0.0

    def minus(self, earlier: Counters) -> Counters:
        if self.requests < earlier.requests or self.ttft_count < earlier.ttft_count:
            return self  # the frontend restarted: everything since its start is new
        return Counters(*(getattr(self, f) - getattr(earlier, f) for f in self.__dataclass_fields__))

    def plus(self, other: Counters) -> Counters:
        return Counters(*(getattr(self, f) + getattr(other, f) for f in self.__dataclass_fields__))


def parse_counters(text: str) -> Counters:
    counters = Counters()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = _SAMPLES.get(sample.name)
            if name is not None:
                setattr(counters, name, getattr(counters, name) + sample.value)
    return counters


def traffic_of(delta: Counters, seconds: float) -> Traffic:
    n = delta.requests
    return Traffic(
        rate_per_s=n / seconds if seconds > 0 else 0.0,
        mean_input_tokens=delta.prompt_tokens / n if n else 0.0,
        mean_output_tokens=delta.completion_tokens / n if n else 0.0,
        observed_ttft_s=delta.ttft_sum / delta.ttft_count if delta.ttft_count else None,
        observed_itl_s=delta.itl_sum / delta.itl_count if delta.itl_count else None,
    )


@dataclass
class FrontendTraffic:
    """Reads every frontend's metrics; `sample()` gives the traffic since the previous call."""

    frontends: ComponentView
    client: httpx.AsyncClient = field(default_factory=lambda: httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S))
    _last: dict[str, Counters] = field(default_factory=dict)
    _last_at: float | None = None

    async def sample(self, now: float) -> Traffic:
        members = dict(self.frontends.instances)
        readings = await asyncio.gather(*(self._read(f"{info.address.rsplit(':', 1)[0]}:{info.metrics_port}")
                                          for info in members.values()))
        total = Counters()
        current: dict[str, Counters] = {}
        for instance_id, reading in zip(members, readings, strict=True):
            if reading is None:
                if instance_id in self._last:
                    current[instance_id] = self._last[instance_id]  # skipped this time, not reset
                continue
            current[instance_id] = reading
            total = total.plus(reading.minus(self._last.get(instance_id, reading)))
        seconds = 0.0 if self._last_at is None else now - self._last_at
        self._last, self._last_at = current, now
        return traffic_of(total, seconds)

    async def _read(self, host_port: str) -> Counters | None:
        try:
            response = await self.client.get(f"http://{host_port}/metrics")
            response.raise_for_status()
        except httpx.HTTPError as exc:
            log.warning("could not read the metrics of the frontend at %s: %s", host_port, exc)
            return None
        return parse_counters(response.text)

    async def close(self) -> None:
        await self.client.aclose()
