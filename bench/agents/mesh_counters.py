"""What the mesh's own metrics say of a run: blocks loaded back from the host tier, the workers' session pins,
and how the router routed session requests. Read from the decode workers' and the router's /metrics at the
end of a run (a fresh mesh per run, so counters start at zero), summed over workers; the router's session
routes are kept per `route` label.

A metric a mesh does not export (a mode without sessions, or a build before them) is simply absent.
"""

from __future__ import annotations

from collections.abc import Iterable

from bench.common.mesh_metrics import metrics_urls
from services.mesh.discovery import DECODE_WORKER, ROUTER
from testkit import metrics
from testkit.mesh import LaunchedMesh

WORKER_SAMPLES = (
    "kvmesh_worker_host_hits_total",  # prompt blocks loaded back from the host tier
    "kvmesh_worker_session_pins",  # sessions kept, now
    "kvmesh_worker_session_pinned_blocks",  # device blocks pinned for idle sessions, now
    "kvmesh_worker_session_host_blocks",  # host blocks kept for idle sessions, now
    "kvmesh_worker_session_pin_budget_blocks",
    "kvmesh_worker_session_prefetched_blocks_total",
    "kvmesh_worker_session_demoted_blocks_total",
)
READ_TIMEOUT_S = 30.0
ROUTER_SAMPLES = ("kvmesh_router_session_routes_total", "kvmesh_router_session_bindings")


def _samples(urls: Iterable[str], wanted: tuple[str, ...], by_label: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for url in urls:
        samples = metrics.scrape(url, READ_TIMEOUT_S)
        for sample in (s for name in wanted for s in metrics.matching(samples, name)):
            key = sample.name
            if by_label and by_label in sample.labels:
                key += f"{{{by_label}={sample.labels[by_label]}}}"
            out[key] = out.get(key, 0.0) + sample.value
    return out


def find(mesh: LaunchedMesh) -> dict[str, list[str]]:
    """The /metrics URLs of the mesh's decode workers and router: found while the mesh is idle (the search
    tries each listening port with a short timeout, which a busy worker process may miss)."""
    urls = metrics_urls(mesh, (DECODE_WORKER, ROUTER))
    if DECODE_WORKER not in urls:
        raise RuntimeError("agents: found no decode worker's /metrics")
    return urls


def read(urls: dict[str, list[str]]) -> dict[str, float]:
    """The samples above, summed over the mesh's decode workers, and the router's."""
    return {**_samples(urls.get(DECODE_WORKER, []), WORKER_SAMPLES),
            **_samples(urls.get(ROUTER, []), ROUTER_SAMPLES, by_label="route")}
