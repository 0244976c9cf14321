"""Prometheus exposition for the mesh's processes (each with its own registry, no globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server

# Latency buckets from 1 ms to 60 s: TTFT on the mocker is sub-ms, on a long prompt seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def serve_metrics(registry: CollectorRegistry, host: str, port: int = 0) -> int:
    """Serves /metrics on a background thread; returns the bound port."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)
