"""The kubernetes connector against a real HTTP server playing the Kubernetes API (no cluster
exists here): the requests the official client sends are recorded, and what they would make of
the Deployments' Scale objects is validated against the Kubernetes schemas."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import kubernetes_validate
import pytest
from kubernetes import client
from kubernetes_validate.utils import latest_version

from services.config_error import ConfigError
from services.planner.connectors.base import ConnectorError
from services.planner.connectors.kubernetes import KubernetesConnector, KubernetesTarget, scale_patch
from services.planner.pools import PoolSizes

NAMESPACE = "kvmesh"
SCALE_PATH = "/apis/apps/v1/namespaces/kvmesh/deployments/{}/scale"


class FakeApiServer(ThreadingHTTPServer):
    """Answers GET and PATCH on the two Deployments' scale subresource; records every request."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.replicas = {"prefill-worker": 1, "decode-worker": 3}
        self.requests: list[tuple[str, str, str, dict | None]] = []
        self.refuse_with: int | None = None

    def scale(self, name: str) -> dict:
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": name, "namespace": NAMESPACE},
                "spec": {"replicas": self.replicas[name]}, "status": {"replicas": self.replicas[name]}}


class _Handler(BaseHTTPRequestHandler):
    server: FakeApiServer

    def do_GET(self) -> None:  # noqa: N802
        self._answer(None)

    def do_PATCH(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._answer(body)

    def _answer(self, body: dict | None) -> None:
        self.server.requests.append((self.command, self.path, self.headers.get("Content-Type", ""), body))
        name = next((n for n in self.server.replicas if self.path.split("?")[0] == SCALE_PATH.format(n)), None)
        if self.server.refuse_with is not None or name is None:
            code = self.server.refuse_with or 404
            self._send(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
                              "reason": "Forbidden" if code == 403 else "NotFound"})
            return
        if body is not None:
            self.server.replicas[name] = body["spec"]["replicas"]
        self._send(200, self.server.scale(name))

    def _send(self, code: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    server = FakeApiServer()
    # A short poll: shutdown() waits up to one poll interval (0.5 s by default) per test.
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def connector(api: FakeApiServer) -> KubernetesConnector:
    configuration = client.Configuration(host=f"http://127.0.0.1:{api.server_address[1]}")
    return KubernetesConnector(KubernetesTarget(NAMESPACE), client.ApiClient(configuration))


def test_reads_the_pools_from_the_scale_subresources(api: FakeApiServer) -> None:
    k8s = connector(api)
    assert asyncio.run(k8s.current()) == PoolSizes(prefill=1, decode=3)
    assert sorted(path for method, path, _, _ in api.requests if method == "GET") == [
        SCALE_PATH.format("decode-worker"), SCALE_PATH.format("prefill-worker")]


def test_a_plan_patches_only_the_pool_that_changes_with_a_valid_scale(api: FakeApiServer) -> None:
    k8s = connector(api)
    assert asyncio.run(k8s.apply(PoolSizes(1, 3), PoolSizes(2, 3))) == 0
    (patch,) = [r for r in api.requests if r[0] == "PATCH"]
    method, path, content_type, body = patch
    assert path == SCALE_PATH.format("prefill-worker")
    assert content_type in ("application/merge-patch+json", "application/strategic-merge-patch+json",
                            "application/json-patch+json")
    assert body == scale_patch(2) == {"spec": {"replicas": 2}}
    # What the patch makes of the served Scale is a valid autoscaling/v1 Scale...
    served = api.scale("prefill-worker")
    kubernetes_validate.validate({**served, "spec": {**served["spec"], **body["spec"]}}, latest_version(), strict=True)
    assert api.replicas == {"prefill-worker": 2, "decode-worker": 3}
    # ...and the check can fail: a replica count that is not an integer is refused.
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({**served, "spec": {"replicas": "two"}}, latest_version(), strict=True)


def test_a_refusal_names_the_deployment_in_one_line(api: FakeApiServer) -> None:
    api.refuse_with = 403
    with pytest.raises(ConnectorError, match=r"deployment kvmesh/decode-worker: the API server answered 403") as err:
        asyncio.run(connector(api).apply(PoolSizes(1, 3), PoolSizes(1, 4)))
    assert "\n" not in str(err.value)


def test_an_unreachable_api_server_is_a_connector_error() -> None:
    configuration = client.Configuration(host="http://127.0.0.1:1")
    k8s = KubernetesConnector(KubernetesTarget(NAMESPACE), client.ApiClient(configuration))
    with pytest.raises(ConnectorError, match="unreachable"):
        asyncio.run(k8s.current())


@pytest.mark.parametrize("kwargs, flag", [({"namespace": "Kv_Mesh"}, "--k8s-namespace"),
                                          ({"namespace": "ok", "decode_deployment": ""}, "--k8s-decode-deployment")])
def test_a_bad_target_names_its_flag(kwargs: dict, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        KubernetesTarget(**kwargs)
