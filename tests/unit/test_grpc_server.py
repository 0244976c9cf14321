"""The mesh's gRPC server options, in-process: reflection only when asked for, and /health on the
side port following the runner's state."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import CollectorRegistry

from services.mesh.channels import open_channel
from services.mesh.grpc_server import start_server
from services.mesh.metrics_http import serve_metrics
from services.mesh.tls import TlsConfig
from tests.certs import Authority, CertFiles


async def _list_services(reflect: bool) -> list[str] | grpc.StatusCode:
    server, port, _ = await start_server([], "127.0.0.1", 0, reflect=reflect)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                             timeout=5)
            try:
                async for reply in call:
                    return [s.name for s in reply.list_services_response.service]
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return []
    finally:
        await server.stop(0)


def test_reflection_is_off_unless_asked_for() -> None:
    assert asyncio.run(_list_services(reflect=False)) == grpc.StatusCode.UNIMPLEMENTED
    listed = asyncio.run(_list_services(reflect=True))
    assert isinstance(listed, list) and "grpc.health.v1.Health" in listed


def test_side_port_health_follows_the_serving_state() -> None:
    state = {"serving": False, "alive": True}
    server = serve_metrics(CollectorRegistry(), "127.0.0.1", 0, ready=lambda: state["serving"],
                           alive=lambda: state["alive"])
    base = f"http://127.0.0.1:{server.server_port}"
    try:
        assert httpx.get(f"{base}/health", timeout=5).status_code == 503
        assert httpx.get(f"{base}/live", timeout=5).status_code == 200
        state["serving"] = True
        assert httpx.get(f"{base}/health", timeout=5).status_code == 200
        state["alive"] = False  # the event loop stopped beating
        assert httpx.get(f"{base}/live", timeout=5).status_code == 503
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("missing", ["--tls-key", "--tls-ca"])
def test_half_a_tls_setting_is_refused(tmp_path, missing: str) -> None:  # noqa: ANN001
    from services.config_error import ConfigError
    from services.mesh.tls import tls_config

    files = Authority(tmp_path).issue("svc")
    given = {"--tls-cert": str(files.cert), "--tls-key": str(files.key), "--tls-ca": str(files.ca)}
    given[missing] = ""
    with pytest.raises(ConfigError, match=missing):
        tls_config(given["--tls-cert"], given["--tls-key"], given["--tls-ca"])
    assert tls_config(str(files.cert), str(files.key), str(files.ca)) is not None
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(ConfigError, match="not a PEM file"):
        tls_config(str(tmp_path / "junk.pem"), str(files.key), str(files.ca))


async def _health_over_tls(server_files: CertFiles, client: TlsConfig) -> grpc.StatusCode:
    server, port, _ = await start_server([], "127.0.0.1", 0,
                                         tls=TlsConfig(str(server_files.cert), str(server_files.key),
                                                       str(server_files.ca)))
    try:
        async with open_channel(f"127.0.0.1:{port}", client) as channel:
            try:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                return grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                return exc.code()
    finally:
        await server.stop(0)


def test_one_mesh_certificate_for_every_peer_with_a_server_name(tmp_path) -> None:  # noqa: ANN001
    """Peers dial registered addresses (pod IPs); a certificate naming only the mesh's service name
    is accepted when clients check that name instead of the address."""
    ca = Authority(tmp_path)
    shared = ca.issue("mesh", dns_names=("kvmesh.internal",), ips=())
    plain = TlsConfig(str(shared.cert), str(shared.key), str(shared.ca))
    named = TlsConfig(str(shared.cert), str(shared.key), str(shared.ca), server_name="kvmesh.internal")
    assert asyncio.run(_health_over_tls(shared, plain)) == grpc.StatusCode.UNAVAILABLE
    assert asyncio.run(_health_over_tls(shared, named)) == grpc.StatusCode.OK


def test_a_certificate_with_another_certificates_key_is_refused(tmp_path) -> None:  # noqa: ANN001
    from services.config_error import ConfigError
    from services.mesh.tls import tls_config

    ca = Authority(tmp_path)
    one, other = ca.issue("one"), ca.issue("other")
    with pytest.raises(ConfigError, match="not a certificate and its key"):
        tls_config(str(one.cert), str(other.key), str(one.ca))
    with pytest.raises(ConfigError, match="no CA certificate"):
        tls_config(str(one.cert), str(one.key), str(one.key))
