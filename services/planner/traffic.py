"""What the planner knows of the traffic: the frontends' and decode workers' own Prometheus
metrics, scraped.

Every frontend and worker registers the port its /metrics is on. Each interval the planner
reads the cumulative counters and histogram sums of all of them and turns the difference since
the last reading into a `Traffic`: from the frontends the arrival rate (requests per second as
they arrive), and the mean prompt and output length, TTFT and ITL of the requests answered;
from the decode workers where the prompts were prefilled (the share sent to the prefill pool,
and the uncached tokens of each kind); from the workers that prefill and the encode workers
what the encode pool was asked and what an image cost it (encode_pool.py). An instance that
appears starts from its first reading; one that restarted (counters went down) is read from
zero again, so a restart never shows a negative rate. Workers that share a process (the
mocker's `--num-workers`) share its /metrics, which is read once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Generic, Self, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.mesh.discovery import ComponentView, InstanceInfo
from services.planner.encode_pool import EncodeTraffic
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
    "kvmesh_frontend_arrived_requests_total": "arrived",
}


_PREFILL_SAMPLES = {
    "kvmesh_decode_remote_prefill_total": "remote",
    "kvmesh_decode_local_prefill_total": "local",
    "kvmesh_decode_remote_prefill_tokens_total": "remote_tokens",
    "kvmesh_decode_local_prefill_tokens_total": "local_tokens",
    # Every image it wanted from the encode pool, whatever became of it (a prefill worker counts
    # these alone).
    "kvmesh_remote_encodes_total": "encode_asked",
}


_ENCODER_SAMPLES = {
    "kvmesh_encoder_busy_seconds_total": "busy_s",
    "kvmesh_encoder_images_total": "images",
}


class _Sums:
    """Field-wise arithmetic of a dataclass of cumulative counters."""

    def _names(self) -> list[str]:
        return [f.name for f in fields(self)]  # type: ignore[arg-type]

    def minus(self, earlier: Self) -> Self:
        names = self._names()
        if any(getattr(self, n) < getattr(earlier, n) for n in names):
            return self  # the instance restarted: everything since its start is new
        return type(self)(*(getattr(self, n) - getattr(earlier, n) for n in names))  # type: ignore[call-arg]

    def plus(self, other: Self) -> Self:
        return type(self)(*(getattr(self, n) + getattr(other, n) for n in self._names()))  # type: ignore[call-arg]


@dataclass
class Counters(_Sums):
    """A frontend's."""

    requests: float = 0.0
    prompt_tokens: float = 0.0
    completion_tokens: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    itl_sum: float = 0.0
    itl_count: float = 0.0
    arrived: float = 0.0


@dataclass
class PrefillCounters(_Sums):
    """A decode worker's: where it had prompts prefilled, and the images it asked the encode pool
    for (all a prefill worker's counters hold)."""

    remote: float = 0.0
    local: float = 0.0
    remote_tokens: float = 0.0
    local_tokens: float = 0.0
    encode_asked: float = 0.0


@dataclass
class EncoderCounters(_Sums):
    """An encode worker's: its encoder's busy seconds and the images it encoded."""

    busy_s: float = 0.0
    images: float = 0.0


_C = TypeVar("_C", bound=_Sums)


def parse_counters(text: str) -> Counters:
    return _parse(text, Counters(), _SAMPLES)


def parse_prefill_counters(text: str) -> PrefillCounters:
    return _parse(text, PrefillCounters(), _PREFILL_SAMPLES)


def parse_encoder(text: str) -> EncoderCounters:
    return _parse(text, EncoderCounters(), _ENCODER_SAMPLES)


def encode_traffic_of(asked: float, encoded: EncoderCounters, seconds: float) -> EncodeTraffic:
    """`asked`: the images the workers that prefill asked the encode pool for in `seconds`."""
    return EncodeTraffic(rate_per_s=asked / seconds if seconds > 0 else 0.0,
                         service_s=encoded.busy_s / encoded.images if encoded.images else None)


def _parse(text: str, counters: _C, samples: dict[str, str]) -> _C:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = samples.get(sample.name)
            if name is not None:
                setattr(counters, name, getattr(counters, name) + sample.value)
    return counters


def traffic_of(delta: Counters, seconds: float, prefill: PrefillCounters | None = None) -> Traffic:
    n = delta.requests
    prefilled = 0.0 if prefill is None else prefill.remote + prefill.local
    # The load is what arrived: the requests answered understate it while a pool is saturated.
    # (A frontend without the arrivals counter is read by its answers.)
    arrived = delta.arrived or n
    return Traffic(
        rate_per_s=arrived / seconds if seconds > 0 else 0.0,
        mean_input_tokens=delta.prompt_tokens / n if n else 0.0,
        mean_output_tokens=delta.completion_tokens / n if n else 0.0,
        observed_ttft_s=delta.ttft_sum / delta.ttft_count if delta.ttft_count else None,
        observed_itl_s=delta.itl_sum / delta.itl_count if delta.itl_count else None,
        remote_share=prefill.remote / prefilled if prefill is not None and prefilled else None,
        remote_prompt_tokens=prefill.remote_tokens / prefill.remote if prefill is not None and prefill.remote else None,
        local_prompt_tokens=prefill.local_tokens / prefill.local if prefill is not None and prefill.local else None,
    )


@dataclass
class _Deltas(Generic[_C]):
    """The sum over a component's instances of what each counted since the previous reading."""

    view: ComponentView
    parse: Callable[[str], _C]
    empty: Callable[[], _C]
    client: httpx.AsyncClient
    what: str
    # Instances that share a /metrics share a process (the mocker's workers): read it once. Not
    # for frontends, whose shared port (--reuse-port) is one of several processes at random.
    shared_process: bool = True
    _last: dict[str, _C] = field(default_factory=dict)

    async def read(self) -> _C:
        members = {i.instance_id if not self.shared_process else _endpoint(i): _endpoint(i)
                   for i in self.view.instances.values()}
        keys = sorted(members)
        readings = await asyncio.gather(*(self._read(members[key]) for key in keys))
        total = self.empty()
        current: dict[str, _C] = {}
        for key, reading in zip(keys, readings, strict=True):
            if reading is None:
                if key in self._last:
                    current[key] = self._last[key]  # skipped this time, not reset
                continue
            current[key] = reading
            total = total.plus(reading.minus(self._last.get(key, reading)))
        self._last = current
        return total

    async def _read(self, host_port: str) -> _C | None:
        try:
            response = await self.client.get(f"http://{host_port}/metrics")
            response.raise_for_status()
        except httpx.HTTPError as exc:
            log.warning("could not read the metrics of the %s at %s: %s", self.what, host_port, exc)
            return None
        return self.parse(response.text)


def _endpoint(info: InstanceInfo) -> str:
    return f"{info.address.rsplit(':', 1)[0]}:{info.metrics_port}"


# The routers' admission gauges (read as they are, not as differences).
QUEUED = "kvmesh_admission_queued"
PREDICTED_WAIT = "kvmesh_admission_predicted_wait_seconds"


def parse_queue(text: str) -> tuple[float, float]:
    """(requests waiting, predicted wait) in one router's metrics."""
    queued = wait = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == QUEUED:
                queued += sample.value
            elif sample.name == PREDICTED_WAIT:
                wait = max(wait, sample.value)
    return queued, wait


class MeshTraffic:
    """Reads every frontend's, decode worker's and router's metrics; `sample()` gives the
    traffic since the previous call, with the routers' queues as they are now."""

    def __init__(self, frontends: ComponentView, decode_workers: ComponentView,
                 routers: ComponentView | None = None, prefill_workers: ComponentView | None = None,
                 encode_workers: ComponentView | None = None) -> None:
        """`prefill_workers` and `encode_workers`: read for the encode pool (None: not sized)."""
        self.client = httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S)
        self._routers = routers
        self._frontends = _Deltas(frontends, parse_counters, Counters, self.client, "frontend", shared_process=False)
        self._workers = _Deltas(decode_workers, parse_prefill_counters, PrefillCounters, self.client, "decode worker")
        # The decode workers' images asked come with their prefill counters, in the same reading.
        self._prefill_workers = None if prefill_workers is None or encode_workers is None else _Deltas(
            prefill_workers, parse_prefill_counters, PrefillCounters, self.client, "prefill worker")
        self._encoders = None if encode_workers is None else _Deltas(encode_workers, parse_encoder, EncoderCounters,
                                                                     self.client, "encode worker")
        self._last_at: float | None = None
        # The latest interval in which requests were answered: the shape of the traffic.
        self._shape: Traffic | None = None

    async def sample(self, now: float) -> Traffic:
        answered, prefilled, (queued, wait), (prefill_asked, encoded) = await asyncio.gather(
            self._frontends.read(), self._workers.read(), self._queues(), self._encode_counters())
        seconds = 0.0 if self._last_at is None else now - self._last_at
        self._last_at = now
        traffic = traffic_of(answered, seconds, prefilled)
        if answered.requests:
            self._shape = traffic
        elif not traffic.idle and self._shape is not None:
            # Requests arrived and none was answered (a stalled pool): their lengths are taken
            # to be those of the last requests answered, not zero, which would read as no load.
            shape = self._shape
            traffic = replace(traffic, mean_input_tokens=shape.mean_input_tokens,
                              mean_output_tokens=shape.mean_output_tokens, remote_share=shape.remote_share,
                              remote_prompt_tokens=shape.remote_prompt_tokens,
                              local_prompt_tokens=shape.local_prompt_tokens)
        encode = encode_traffic_of(prefilled.encode_asked + prefill_asked, encoded, seconds)
        return replace(traffic, queued=queued, queue_wait_s=wait, encode=encode)

    async def _encode_counters(self) -> tuple[float, EncoderCounters]:
        """The prefill workers' images asked of the encode pool, and the encode workers' counters
        (nothing where the pool is not sized)."""
        if self._prefill_workers is None or self._encoders is None:
            return 0.0, EncoderCounters()
        asked, encoded = await asyncio.gather(self._prefill_workers.read(), self._encoders.read())
        return asked.encode_asked, encoded

    async def _queues(self) -> tuple[float, float]:
        """Requests waiting in all the routers' queues, and the longest predicted wait."""
        if self._routers is None:
            return 0.0, 0.0
        routers = list(self._routers.instances.values())
        texts = await asyncio.gather(*(self._text(f"{r.address.rsplit(':', 1)[0]}:{r.metrics_port}")
                                       for r in routers))
        readings = [parse_queue(t) for t in texts if t is not None]
        return sum(q for q, _ in readings), max((w for _, w in readings), default=0.0)

    async def _text(self, host_port: str) -> str | None:
        try:
            response = await self.client.get(f"http://{host_port}/metrics")
            response.raise_for_status()
        except httpx.HTTPError as exc:
            log.warning("could not read the metrics of the router at %s: %s", host_port, exc)
            return None
        return response.text

    async def close(self) -> None:
        await self.client.aclose()
