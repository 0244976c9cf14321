"""Mutual TLS, for real: certificates made here, etcd serving https with client-certificate auth,
and a mesh (router, processor, frontend, a mocker worker) whose every gRPC hop is mTLS.

A request through the frontend proves the mesh's own channels present valid certificates; then
strangers knock on the internal RPCs (`FindMatches`, the worker's KV-event stream): a plaintext
client, a TLS client without a certificate and one with a certificate from another CA are all
refused, while a client holding a mesh certificate gets its answer.
"""

from __future__ import annotations

import asyncio
import shutil
import ssl
import struct
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest

from gen.kvmesh.v1 import carrier_pb2, carrier_pb2_grpc, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.mesh.etcd_store import StoreUnavailable
from services.mesh.session_carrier import read_frame
from services.mesh.session_kind import ROUTER_SESSION
from services.mesh.tls import TlsConfig
from testkit.etcd import Etcd, EtcdTls
from tests.certs import Authority, CertFiles
from tests.procs import MODEL, ServiceMesh, registered, service, wait_until

pytestmark = pytest.mark.timeout(240)


@dataclass
class Pki:
    ca: Authority
    rogue: Authority
    etcd: CertFiles
    mesh: CertFiles
    stranger: CertFiles  # signed by the rogue CA


@pytest.fixture(scope="module")
def pki() -> Iterator[Pki]:
    root = Path(tempfile.mkdtemp(prefix="kvmesh-test-pki-"))
    ca, rogue = Authority(root / "ca"), Authority(root / "rogue", "rogue-ca")
    yield Pki(ca, rogue, ca.issue("etcd"), ca.issue("mesh"), rogue.issue("stranger"))
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def tls_etcd(pki: Pki) -> Iterator[str]:
    with Etcd.running(tls=EtcdTls(pki.etcd.cert, pki.etcd.key, pki.ca.ca_file), name="etcd-tls") as etcd:
        yield etcd.endpoint


@dataclass
class TlsMesh:
    etcd: str
    namespace: str
    http_port: int
    tls: TlsConfig
    mesh: ServiceMesh

    def address(self, component: str) -> str:
        (info, *_) = registered(self.etcd, self.namespace, component, self.tls)
        return info.address


@pytest.fixture(scope="module")
def tls_mesh(tls_etcd: str, pki: Pki) -> Iterator[TlsMesh]:
    with ServiceMesh(tls_etcd, flags=pki.mesh.flags(), namespace="tls-mesh") as mesh:
        mesh.worker()
        assert wait_until(lambda: mesh.complete().status_code == 200, 20)
        yield TlsMesh(tls_etcd, mesh.namespace, mesh.port,
                      TlsConfig(str(pki.mesh.cert), str(pki.mesh.key), str(pki.ca.ca_file)), mesh)


def test_a_request_crosses_a_mesh_whose_every_hop_is_mutual_tls(tls_mesh: TlsMesh) -> None:
    reply = httpx.post(f"http://127.0.0.1:{tls_mesh.http_port}/v1/completions",
                       json={"model": MODEL, "prompt": "hello over tls", "max_tokens": 4}, timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4
    assert reply.headers["x-kvmesh-worker"]


def _knock(port: int, context: ssl.SSLContext | None) -> str:
    """A session hello to the router's TCP carrier: "accepted", or how it was refused."""
    async def knock() -> str:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(
                "127.0.0.1", port, ssl=context, server_hostname="127.0.0.1" if context else None), 10)
            method = ROUTER_SESSION.method.encode()
            writer.write(struct.pack("<I", len(method)) + method)
            await writer.drain()
            answer = await asyncio.wait_for(read_frame(reader, 16), 10)
            writer.close()
        except (OSError, ssl.SSLError) as exc:
            return f"refused: {type(exc).__name__}"
        return "accepted" if answer == b"\x01" else f"refused: answered {answer!r}"

    return asyncio.run(knock())


def test_sessions_cross_tls_on_their_tcp_carrier_which_refuses_strangers(tls_mesh: TlsMesh, pki: Pki) -> None:
    # The mesh's own sessions took the TCP carrier, under TLS.
    processor = next(p for p in tls_mesh.mesh.procs if p.name.startswith("processor"))
    said = "\n".join(processor.lines)
    assert "session to" in said and " over tcp" in said and "over gRPC instead" not in said, processor.tail()
    creds = grpc.ssl_channel_credentials(pki.ca.ca_file.read_bytes(), pki.mesh.key.read_bytes(),
                                         pki.mesh.cert.read_bytes())
    with grpc.secure_channel(tls_mesh.address("kv-router"), creds) as channel:
        port = carrier_pb2_grpc.SessionCarrierStub(channel).Endpoint(carrier_pb2.CarrierRequest(), timeout=5).port
    assert port

    def client(cert: CertFiles | None) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.load_verify_locations(str(pki.ca.ca_file))
        if cert is not None:
            context.load_cert_chain(str(cert.cert), str(cert.key))
        return context

    assert _knock(port, client(pki.mesh)) == "accepted"
    assert _knock(port, None).startswith("refused")  # plaintext
    assert _knock(port, client(None)).startswith("refused")  # no certificate
    assert _knock(port, client(pki.stranger)).startswith("refused")  # another CA's


def _find_matches(channel: grpc.Channel, token_ids: Sequence[int] = range(64)) -> dict[str, int]:
    reply = router_pb2_grpc.RouterStub(channel).FindMatches(
        router_pb2.FindMatchesRequest(model=MODEL, token_ids=token_ids), timeout=5)
    return dict(reply.scores)


def _refused(call) -> grpc.StatusCode:  # noqa: ANN001
    with pytest.raises(grpc.RpcError) as failure:
        call()
    return failure.value.code()


def test_a_client_with_a_mesh_certificate_may_call_find_matches(tls_mesh: TlsMesh, pki: Pki) -> None:
    # Four blocks of 16 tokens the worker caches once it served them (KV events also cross mTLS).
    cached = [100 + i for i in range(64)]
    reply = httpx.post(f"http://127.0.0.1:{tls_mesh.http_port}/v1/completions",
                       json={"model": MODEL, "prompt": [*cached, 7], "max_tokens": 1}, timeout=30)
    assert reply.status_code == 200, reply.text
    home = reply.headers["x-kvmesh-worker"]
    creds = grpc.ssl_channel_credentials(pki.ca.ca_file.read_bytes(), pki.mesh.key.read_bytes(),
                                         pki.mesh.cert.read_bytes())
    with grpc.secure_channel(tls_mesh.address("kv-router"), creds) as channel:
        assert wait_until(lambda: _find_matches(channel, cached) == {home: 4}, 10), _find_matches(channel, cached)


def test_a_plaintext_client_cannot_connect(tls_mesh: TlsMesh) -> None:
    with grpc.insecure_channel(tls_mesh.address("kv-router")) as channel:
        assert _refused(lambda: _find_matches(channel)) == grpc.StatusCode.UNAVAILABLE


def test_a_client_without_a_certificate_is_refused(tls_mesh: TlsMesh, pki: Pki) -> None:
    creds = grpc.ssl_channel_credentials(pki.ca.ca_file.read_bytes())
    with grpc.secure_channel(tls_mesh.address("kv-router"), creds) as channel:
        assert _refused(lambda: _find_matches(channel)) == grpc.StatusCode.UNAVAILABLE


def test_a_certificate_from_another_ca_is_refused_by_routers_and_workers(tls_mesh: TlsMesh, pki: Pki) -> None:
    creds = grpc.ssl_channel_credentials(pki.ca.ca_file.read_bytes(), pki.stranger.key.read_bytes(),
                                         pki.stranger.cert.read_bytes())
    with grpc.secure_channel(tls_mesh.address("kv-router"), creds) as channel:
        assert _refused(lambda: _find_matches(channel)) == grpc.StatusCode.UNAVAILABLE
    with grpc.secure_channel(tls_mesh.address("decode-worker"), creds) as channel:
        events = worker_pb2_grpc.WorkerStub(channel).SubscribeKvEvents(worker_pb2.SubscribeKvEventsRequest(),
                                                                         timeout=5)
        assert _refused(lambda: next(iter(events))) == grpc.StatusCode.UNAVAILABLE


def test_etcd_refuses_a_process_whose_certificate_another_ca_signed(tls_etcd: str, pki: Pki) -> None:
    stranger = TlsConfig(str(pki.stranger.cert), str(pki.stranger.key), str(pki.ca.ca_file))
    with pytest.raises(StoreUnavailable):
        registered(tls_etcd, "tls-mesh", "kv-router", stranger)
    router = service("services.kv_router", "--etcd-endpoints", tls_etcd, "--namespace", "tls-rogue",
                     *pki.stranger.flags()[:4], "--tls-ca", str(pki.ca.ca_file), name="rogue-router")
    try:
        router.popen.wait(60)
    finally:
        router.stop()
    assert router.popen.returncode == 3, router.tail()
    assert "etcd unreachable" in router.tail()


def test_an_https_etcd_is_never_spoken_to_in_plaintext(tls_etcd: str) -> None:
    router = service("services.kv_router", "--etcd-endpoints", tls_etcd, name="plaintext-router")
    router.popen.wait(30)
    router.stop()
    lines = [line for line in router.lines if line.strip()]
    assert router.popen.returncode == 2 and len(lines) == 1, router.tail()
    assert lines[0].startswith("error: --etcd-endpoints https://") and "--tls-cert" in lines[0]
