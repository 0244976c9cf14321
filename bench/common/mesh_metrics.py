"""Prometheus figures of a launched mesh's processes, for the benchmarks: each child's /metrics
found by its listening ports, and histogram quantiles over what happened between two scrapes."""

from __future__ import annotations

import http.client
import math
import urllib.request

from testkit import metrics
from testkit.mesh import LaunchedMesh
from testkit.proc_stat import listening_ports

# Buckets by label value: {upper bound: cumulative count}.
Buckets = dict[str, dict[float, float]]


def metrics_urls(mesh: LaunchedMesh, components: tuple[str, ...]) -> dict[str, list[str]]:
    """Each component's /metrics URLs: the ports its processes listen on that answer one."""
    found: dict[str, list[str]] = {}
    for name, pid in mesh.children:
        if name not in components:
            continue
        for port in listening_ports(pid):
            url = f"http://127.0.0.1:{port}/metrics"
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200 and b"kvmesh_" in r.read(1 << 20):
                        found.setdefault(name, []).append(url)
                        break
            except (OSError, ValueError, http.client.HTTPException):
                continue  # a gRPC port, or one that does not speak HTTP/1
    return found


def histogram(urls: list[str], name: str, label: str) -> Buckets:
    """The histogram `name`'s cumulative buckets per value of `label`, summed over `urls`."""
    out: Buckets = {}
    for url in urls:
        for sample in metrics.matching(metrics.scrape(url, timeout_s=5), name + "_bucket"):
            series = out.setdefault(sample.labels.get(label, ""), {})
            le = float(sample.labels["le"])
            series[le] = series.get(le, 0.0) + sample.value
    return out


def delta(after: Buckets, before: Buckets) -> Buckets:
    return {key: {le: n - before.get(key, {}).get(le, 0.0) for le, n in series.items()}
            for key, series in after.items()}


def quantile(buckets: dict[float, float], q: float) -> float:
    """Prometheus's histogram_quantile: linear within the bucket the rank falls in."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return float("nan")
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * ((rank - below) / (count - below) if count > below else 0.0)
        lower, below = le, count
    return lower
