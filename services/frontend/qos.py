"""What a request asks of admission, read at the edge: its priority (the body's `priority`, as
vLLM accepts it, or the x-kvmesh-priority header; lower is sooner), its own time-to-first-token
objective (x-kvmesh-ttft-objective-ms) and its tenant (the API key's, or the configured header's
value). Bad values are a 400 naming the header, never silently ignored."""

from __future__ import annotations

from collections.abc import Mapping

from gen.kvmesh.v1 import common_pb2
from services.frontend.errors import ApiError
from services.frontend.short_names import request_name
from services.mesh.recent_quantile import RecentQuantile

PRIORITY_HEADER = "x-kvmesh-priority"
OBJECTIVE_HEADER = "x-kvmesh-ttft-objective-ms"
MAX_TENANT_CHARS = 64
MAX_OBJECTIVE_MS = 3_600_000
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


class OutsideQueue:
    """The latency of a first token outside the router's queue (time to first token less the
    queue wait the route reported), over this gateway's recent requests: its 90th percentile is
    what admission must leave of an objective for everything but the queue."""

    def __init__(self) -> None:
        self._quantile = RecentQuantile(0.9)

    @property
    def p90_ms(self) -> int:
        return round(self._quantile.value)

    def observe(self, ttft_s: float, queue_wait_ms: int) -> None:
        self._quantile.observe(max(0.0, ttft_s * 1000 - queue_wait_ms))


def request_qos(headers: Mapping[str, str], body_priority: int | None, tenant: str,
                tenant_header: str | None, outside_queue_ms: int = 0) -> common_pb2.Qos:
    qos = common_pb2.Qos(tenant=tenant, outside_queue_ms=outside_queue_ms)
    if body_priority is not None:
        qos.priority = body_priority
    elif (raw := headers.get(PRIORITY_HEADER)) is not None:
        qos.priority = _integer(raw, PRIORITY_HEADER, INT32_MIN, INT32_MAX)
    if (raw := headers.get(OBJECTIVE_HEADER)) is not None:
        qos.ttft_objective_ms = _integer(raw, OBJECTIVE_HEADER, 1, MAX_OBJECTIVE_MS)
    if tenant_header is not None and (named := headers.get(tenant_header)) is not None:
        qos.tenant = request_name(named, tenant_header, MAX_TENANT_CHARS)
    return qos


def _integer(raw: str, header: str, low: int, high: int) -> int:
    text = raw.strip()
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not low <= value <= high or not text.lstrip("-").isdigit():
        raise ApiError(400, f"the {header} header must be a whole number from {low} to {high}, got {raw[:40]!r}",
                       param=header, code="invalid_value")
    return value
