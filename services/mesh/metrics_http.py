"""Each process's small HTTP side port: Prometheus `/metrics`, readiness `/health`, liveness `/live`.

Probes use this port rather than gRPC health because internal gRPC may require a client
certificate (mTLS) that a kubelet or a load balancer does not have. `/health` is 200 only while
the process serves (assembled, registered, not draining), 503 before and while it drains, so an
orchestrator stops sending it traffic first; `/live` is 200 while the process's event loop keeps
beating (`alive`), so a wedged loop gets the process restarted.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

# Latency buckets from 1 ms to 60 s: TTFT on the mocker is sub-ms, on a long prompt seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def serve_metrics(registry: CollectorRegistry, host: str, port: int = 0,
                  ready: Callable[[], bool] = lambda: True,
                  alive: Callable[[], bool] = lambda: True) -> ThreadingHTTPServer:
    """Serves the side port on a daemon thread (it dies with the process); returns the server."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server protocol
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path == "/health":
                ok = ready()
                self._reply(200 if ok else 503, b'{"status":"ok"}' if ok else b'{"status":"unavailable"}',
                            "application/json")
            elif path == "/live":
                ok = alive()
                self._reply(200 if ok else 503, b'{"status":"ok"}' if ok else b'{"status":"stalled"}',
                            "application/json")
            else:
                self._reply(404, b'{"status":"not found"}', "application/json")

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - scrapes are not events
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
