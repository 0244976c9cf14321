"""Mutual TLS for the mesh's internal gRPC and for etcd: one CA, one certificate per process.

Rule: with `--tls-cert/--tls-key/--tls-ca` every gRPC server this process runs requires a client
certificate signed by the CA, and every channel it opens presents its own certificate and
accepts only servers signed by the CA. A plaintext or unknown client fails the handshake, so
internal RPCs (`ReleaseKv`, `FindMatches`, the KV-event streams) are callable only by holders of
a mesh certificate. Without the flags everything is plaintext: bind internal ports to a private
network then.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from services.config_error import ConfigError

CERT_ENV, KEY_ENV, CA_ENV = "KVMESH_TLS_CERT", "KVMESH_TLS_KEY", "KVMESH_TLS_CA"
SERVER_NAME_ENV = "KVMESH_TLS_SERVER_NAME"
_PEM_MARK = b"-----BEGIN "


@dataclass(frozen=True)
class TlsConfig:
    """PEM files: this process's certificate chain and key, and the CA that signs every peer."""

    cert_file: str
    key_file: str
    ca_file: str
    # Peers dial each other at the address they registered (a pod IP on Kubernetes), which a
    # shared mesh certificate cannot list. With a server name, every peer's certificate is
    # checked against this name instead (one certificate for the whole mesh, SAN = this name).
    server_name: str | None = None
    # Read once at start-up (a rotated certificate takes a restart, as a rolling upgrade does).
    cert: bytes = field(init=False, repr=False)
    key: bytes = field(init=False, repr=False)
    ca: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name, flag, path in (("cert", "--tls-cert", self.cert_file), ("key", "--tls-key", self.key_file),
                                 ("ca", "--tls-ca", self.ca_file)):
            object.__setattr__(self, name, _read_pem(flag, path))
        _check_pair(self.cert_file, self.key_file, self.ca_file)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_options(self) -> list[tuple[str, str]]:
        return [] if not self.server_name else [("grpc.ssl_target_name_override", self.server_name)]

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def server_ssl_context(self) -> ssl.SSLContext:
        """The same rule for a plain TLS server (session_carrier.py): a client certificate the CA signed."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert_file, self.key_file)
        context.load_verify_locations(cadata=self.ca.decode())
        context.verify_mode = ssl.CERT_REQUIRED
        return context

    def client_ssl_context(self) -> ssl.SSLContext:
        """The same rule for a plain TLS client: this process's certificate, a server the CA signed
        (its name checked against `server_name` where set, as the channels do)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.load_cert_chain(self.cert_file, self.key_file)
        context.load_verify_locations(cadata=self.ca.decode())
        return context


def tls_config(cert: str | None, key: str | None, ca: str | None,
               server_name: str | None = None) -> TlsConfig | None:
    """All three files or none: half a TLS setting would silently fall back to plaintext."""
    given = {"--tls-cert": cert, "--tls-key": key, "--tls-ca": ca}
    if not any(given.values()):
        if server_name:
            raise ConfigError("--tls-server-name needs --tls-cert, --tls-key and --tls-ca")
        return None
    missing = [flag for flag, value in given.items() if not value]
    if missing:
        raise ConfigError(f"{', '.join(missing)} missing: TLS needs --tls-cert, --tls-key and --tls-ca together")
    assert cert and key and ca
    return TlsConfig(cert, key, ca, server_name or None)


def tls_flag_defaults() -> dict[str, str | None]:
    return {"cert": os.environ.get(CERT_ENV) or None, "key": os.environ.get(KEY_ENV) or None,
            "ca": os.environ.get(CA_ENV) or None, "server_name": os.environ.get(SERVER_NAME_ENV) or None}


def _check_pair(cert: str, key: str, ca: str) -> None:
    """The certificate matches the key and the CA file holds certificates: found at start-up
    (and by --check-config), not as a failed bind after the process joined etcd."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_cert_chain(cert, key)
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigError(f"--tls-cert {cert} / --tls-key {key}: not a certificate and its key ({exc})") from None
    try:
        context.load_verify_locations(ca)
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigError(f"--tls-ca {ca}: no CA certificate in it ({exc})") from None


def _read_pem(flag: str, path: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read ({exc.strerror})") from None
    if _PEM_MARK not in data:
        raise ConfigError(f"{flag} {path}: not a PEM file")
    return data
