"""The production options of the gateway and the side ports, on real processes.

A second frontend joins the session's mocker mesh with several API keys (from the environment
and from a file), its health and metrics on a separate port, routing details hidden and JSON
logs; every service's side port answers /health, /live and /metrics.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from services.mesh.net import free_port
from tests.procs import MODEL, Mesh, Proc, registered, service, wait_until

pytestmark = pytest.mark.timeout(180)

ENV_KEY, FILE_KEYS = "env-key-1", ("file-key-a", "file-key-b")


@dataclass
class Gateway:
    proc: Proc
    public: str
    admin: str


@pytest.fixture(scope="module")
def gateway(mocker_mesh: Mesh, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    key_file: Path = tmp_path_factory.mktemp("keys") / "api-keys"
    key_file.write_text(f"# rotated monthly\n{FILE_KEYS[0]}\n\n  {FILE_KEYS[1]}  \n")
    port, admin = free_port(), free_port()
    proc = service("services.frontend", "--etcd-endpoints", mocker_mesh.etcd, "--namespace", mocker_mesh.namespace,
                   "--http-port", str(port), "--metrics-port", str(admin), "--hide-routing-details",
                   "--api-key-file", str(key_file), "--log-format", "json",
                   env={"KVMESH_API_KEY": ENV_KEY}, name="guarded-frontend")
    try:
        proc.wait_for("listening on", 60)
        gw = Gateway(proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}")
        assert wait_until(lambda: httpx.get(f"{gw.admin}/health", timeout=5).status_code == 200, 30)
        yield gw
    finally:
        assert proc.stop() == 0, proc.tail()


def _complete(gw: Gateway, key: str, **extra: object) -> httpx.Response:
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 3, **extra}
    return httpx.post(f"{gw.public}/v1/completions", json=body, headers={"authorization": f"Bearer {key}"},
                      timeout=30)


@pytest.mark.parametrize("key", [ENV_KEY, *FILE_KEYS])
def test_every_configured_key_is_accepted(gateway: Gateway, key: str) -> None:
    assert _complete(gateway, key).status_code == 200


@pytest.mark.parametrize("key", ["# rotated monthly", "file-key-", "env-key-1,file-key-a", "FILE-KEY-A"])
def test_anything_else_is_401(gateway: Gateway, key: str) -> None:
    reply = _complete(gateway, key)
    assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"


def test_health_and_metrics_live_only_on_the_metrics_port(gateway: Gateway) -> None:
    for path in ("/health", "/live", "/metrics"):
        assert httpx.get(f"{gateway.public}{path}", timeout=5).status_code == 404, path
    assert httpx.get(f"{gateway.admin}/live", timeout=5).json() == {"status": "ok"}
    assert _complete(gateway, ENV_KEY).json()["usage"]["completion_tokens"] == 3
    text = httpx.get(f"{gateway.admin}/metrics", timeout=5).text
    assert "kvmesh_frontend_requests_total" in text
    (counted,) = [float(line.split()[-1]) for line in text.splitlines()
                  if line.startswith("kvmesh_frontend_completion_tokens_total ")]
    assert counted >= 3
    assert httpx.get(f"{gateway.admin}/v1/models", timeout=5).status_code == 404


def test_routing_details_are_hidden(gateway: Gateway) -> None:
    reply = _complete(gateway, ENV_KEY)
    assert reply.status_code == 200
    assert "x-kvmesh-worker" not in reply.headers and "x-kvmesh-prefill" not in reply.headers
    assert reply.headers["x-request-id"]
    usage = reply.json()["usage"]
    assert usage["prompt_tokens"] > 0 and "prompt_tokens_details" not in usage
    with httpx.stream("POST", f"{gateway.public}/v1/completions", headers={"authorization": f"Bearer {ENV_KEY}"},
                      json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True,
                            "stream_options": {"include_usage": True}}, timeout=30) as stream:
        assert "x-kvmesh-worker" not in stream.headers
        events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    assert events[-1]["usage"]["completion_tokens"] == 2 and "prompt_tokens_details" not in events[-1]["usage"]


def test_json_logs_are_one_object_per_line_with_the_request_id(gateway: Gateway) -> None:
    rid = _complete(gateway, ENV_KEY).headers["x-request-id"]
    assert wait_until(lambda: any(rid in line for line in gateway.proc.lines), 10)
    entries = [json.loads(line) for line in gateway.proc.lines if line.strip()]
    assert all({"ts", "level", "component", "logger", "msg"} <= e.keys() for e in entries)
    assert {e["component"] for e in entries} == {"frontend"}
    (logged,) = [e for e in entries if rid in e["msg"]]
    assert logged["request_id"] == rid and logged["level"] == "INFO"
    assert "hello there" not in json.dumps(entries), "no prompt text at INFO"


@pytest.mark.parametrize("component", ["processor", "kv-router", "decode-worker"])
def test_every_service_has_a_side_port_with_health_and_metrics(mocker_mesh: Mesh, component: str) -> None:
    (info, *_) = registered(mocker_mesh.etcd, mocker_mesh.namespace, component)
    side = f"http://127.0.0.1:{info.metrics_port}"
    assert httpx.get(f"{side}/health", timeout=5).status_code == 200
    assert httpx.get(f"{side}/live", timeout=5).status_code == 200
    assert "# TYPE" in httpx.get(f"{side}/metrics", timeout=5).text
    assert httpx.get(f"{side}/nothing", timeout=5).status_code == 404


def test_hidden_details_leave_mesh_failures_without_their_internals() -> None:
    from services.frontend.errors import ApiError, shown

    failure = ApiError(503, "worker w-17 at 10.0.3.7:50051 failed: UNAVAILABLE", code="unavailable")
    assert shown(failure, hide_internals=False) is failure
    hidden = shown(failure, hide_internals=True)
    assert (hidden.status, hidden.code) == (503, "unavailable") and "10.0.3.7" not in hidden.message
    bad_input = ApiError(400, "max_tokens must be at least 1", param="max_tokens")
    assert shown(bad_input, hide_internals=True) is bad_input
