"""What the bad-input tests share: the demo model's facts, posting raw bodies, and checking the
OpenAI error body and the in-flight gauge."""

from __future__ import annotations

import json

import httpx

from testkit.metrics import scrape, total, value
from tests.conftest import MESH_CONTEXT
from tests.procs import Mesh, wait_until

MODEL = "kvmesh-demo"
CONTEXT = MESH_CONTEXT  # the mocker mesh's served context length (its workers' --max-model-len)
API_KEY = "s3cret"
GUARDED_INFLIGHT = 4
MSG = [{"role": "user", "content": "x"}]


def post(mesh: Mesh, path: str, content: bytes | str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{mesh.base_url}{path}", content=content,
                      headers={"content-type": "application/json", **(headers or {})}, timeout=30)


def assert_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return error


def assert_still_serving(mesh: Mesh) -> None:
    r = post(mesh, "/completions", json.dumps({"model": MODEL, "prompt": "still there?", "max_tokens": 2}))
    assert r.status_code == 200, r.text


def inflight(metrics_url: str) -> float:
    return value(scrape(metrics_url), "kvmesh_frontend_inflight_requests")


def requests_total(metrics_url: str, endpoint: str, status: str) -> float:
    return total(scrape(metrics_url), "kvmesh_frontend_requests_total", endpoint=endpoint, status=status)


def inflight_returns_to_zero(metrics_url: str, timeout_s: float = 15) -> bool:
    return wait_until(lambda: inflight(metrics_url) == 0, timeout_s, 0.05)


def mesh_metrics_url(mesh: Mesh) -> str:
    return mesh.base_url.removesuffix("/v1") + "/metrics"


def completion(**fields: object) -> str:
    return json.dumps({"model": MODEL, "prompt": "x", **fields})
