"""The Grafana dashboard (deploy/grafana/kvmesh-dashboard.json) asks only for metrics the code exports.

Offline: the file is a Grafana dashboard JSON model whose panels all query the Prometheus
datasource chosen by its `datasource` variable, and it covers what an operator watches (TTFT,
ITL, throughput, KV hit rate, remote vs local prefill, KV transfers, per-worker load,
migrations, errors). Live: a small mocker mesh with a prefill worker (real etcd, every service
its own process) serves a short and a long prompt, the long one prefilled remotely so the KV
transfer metrics have samples; then every metric name in every panel query must be among the
names that the frontend's and every component's /metrics expose. A family declared without
samples yet counts: its `# TYPE` line names it, and a counter's `_total` or a histogram's
`_bucket`/`_sum`/`_count` samples follow from its type.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.mesh.discovery import DECODE_WORKER, PREFILL_WORKER, PROCESSOR, ROUTER
from services.worker.load_collector import LOAD_FIELDS
from testkit.metrics import parse
from tests.procs import ROOT, Etcd, ServiceMesh, wait_until

DASHBOARD = ROOT / "deploy" / "grafana" / "kvmesh-dashboard.json"
METRIC = re.compile(r"\bkvmesh_[a-z0-9_]+")
# Prompts with more uncached tokens than this are prefilled on the prefill worker.
MAX_LOCAL_PREFILL = 64
# Names the dashboard must use: one per thing an operator watches.
REQUIRED = {
    "kvmesh_frontend_time_to_first_token_seconds_bucket",  # TTFT
    "kvmesh_frontend_inter_token_latency_seconds_bucket",  # ITL
    "kvmesh_frontend_requests_total",  # throughput, errors by status
    "kvmesh_router_prompt_tokens_total",  # tokens / s
    "kvmesh_router_overlap_tokens_total",  # KV hit rate
    "kvmesh_decode_remote_prefill_total", "kvmesh_decode_local_prefill_total",
    "kvmesh_kv_transfer_bytes_total", "kvmesh_kv_transfer_duration_seconds_bucket",
    "kvmesh_kv_active_blocks", "kvmesh_num_requests_waiting", "kvmesh_gpu_cache_usage_perc",
    "kvmesh_processor_migrations_total",
}
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("_sum", "_count", "_created"), "gauge": ("",), "unknown": ("",), "info": ("_info",)}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def graph_panels(d: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel that draws something, including those nested in collapsed rows."""
    out = []
    for panel in d["panels"]:
        out += [p for p in panel.get("panels", [])]
        if panel["type"] != "row":
            out.append(panel)
    return out


def queries() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in graph_panels(dashboard()) for t in p["targets"]]


def used_metrics() -> set[str]:
    return {name for _, expr in queries() for name in METRIC.findall(expr)}


def exported_names(text: str) -> set[str]:
    """Every sample name a /metrics page exposes or, for a family without samples yet, would."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
        names |= {s.name for s in family.samples}
    return names


def test_the_dashboard_is_a_grafana_model_on_a_prometheus_datasource_variable() -> None:
    d = dashboard()
    assert d["title"] and d["uid"] and isinstance(d["schemaVersion"], int)
    (variable,) = [v for v in d["templating"]["list"] if v["type"] == "datasource"]
    assert variable["query"] == "prometheus"
    ds = {"type": "prometheus", "uid": "${" + variable["name"] + "}"}
    panels = graph_panels(d)
    ids = [p["id"] for p in d["panels"]] + [p["id"] for p in panels if p not in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        assert panel["datasource"] == ds and panel["targets"], panel["title"]
        assert all(t.get("datasource", ds) == ds and t["expr"].strip() for t in panel["targets"]), panel["title"]
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24 and pos["w"] > 0 and pos["h"] > 0, panel["title"]


def test_every_query_names_kvmesh_metrics_with_their_exposition_suffixes() -> None:
    for title, expr in queries():
        names = METRIC.findall(expr)
        assert names, f"{title}: {expr} queries no kvmesh metric"
        # The per-worker load gauges carry the kvmesh_ prefix too.
        for field in LOAD_FIELDS:
            assert not re.search(rf"(?<!kvmesh_)\b{field}\b", expr), f"{title}: {field} without its kvmesh_ prefix"
        # A quantile is taken over histogram buckets, summed by `le`.
        for match in re.finditer(r"histogram_quantile\(\s*[0-9.]+\s*,(.*)\)", expr):
            assert re.search(r"kvmesh_\w+_bucket", match[1]) and re.search(r"by \([^)]*\ble\b", match[1]), expr
        # Counters are read as rates, never as raw running totals.
        for name in names:
            if name.endswith("_total") or name.endswith(("_sum", "_count", "_bucket")):
                assert re.search(rf"(rate|increase)\({name}\b", expr), f"{title}: {name} outside rate()"
    missing = REQUIRED - used_metrics()
    assert not missing, f"the dashboard shows nothing of {sorted(missing)}"


# -- live: the names a running mesh exposes ------------------------------------------------------------

def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(20, 1000) for _ in range(n)]


@pytest.fixture(scope="module")
def disagg(etcd: Etcd) -> Iterator[ServiceMesh]:
    """A decode worker that prefills prompts over MAX_LOCAL_PREFILL tokens on the prefill worker."""
    mesh = ServiceMesh(etcd.endpoint, router_mode="kv")
    try:
        nixl = ("--kv-transfer", "nixl", "--kv-bytes-per-token", "256")
        mesh.worker(*nixl, "--remote-prefill", "--max-local-prefill-length", str(MAX_LOCAL_PREFILL),
                    "--max-prefill-queue-size", "64")
        mesh.prefill_worker(*nixl)
        yield mesh
    finally:
        mesh.stop()


def test_every_metric_on_the_dashboard_is_exported_by_the_running_services(disagg: ServiceMesh) -> None:
    short = disagg.complete("hello", max_tokens=4)
    assert short.status_code == 200, short.text
    # Long prompts until one is prefilled remotely (the router may not list the prefill worker at once).
    seeds = iter(range(1, 1000))
    assert wait_until(lambda: disagg.complete(tokens(next(seeds), 400), max_tokens=4)
                      .headers.get("x-kvmesh-prefill", "").startswith("remote:"), 30, 0.5)
    pages = {"frontend": httpx.get(disagg.url("/metrics"), timeout=10).text}
    pages |= {component: disagg.metrics(component) for component in (PROCESSOR, ROUTER, DECODE_WORKER, PREFILL_WORKER)}
    exported = set().union(*(exported_names(text) for text in pages.values()))
    # The samples these requests must have produced are there (the scrape saw a working mesh).
    assert {"kvmesh_kv_transfer_bytes_total", "kvmesh_frontend_time_to_first_token_seconds_bucket",
            "kvmesh_kv_active_blocks"} <= {s.name for text in pages.values() for s in parse(text)}
    unknown = used_metrics() - exported
    assert not unknown, f"the dashboard queries metrics no service exports: {sorted(unknown)}"
