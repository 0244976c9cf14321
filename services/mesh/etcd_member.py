"""One etcd member's command line: the single place the launcher, the tests and the benchmarks
start etcd from.

A member listens for clients on `host:client_port` and for its peers on `host:peer_port`; its
cluster is every member's name and peer URL (just itself by default). Data lives in `data_dir`,
so stopping a member and starting the same one again is an outage, not a new cluster.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass


def etcd_binary() -> str:
    path = shutil.which("etcd")
    if path is None:
        raise FileNotFoundError("etcd is not installed (run `make install`, or `apt-get install etcd-server`)")
    return path


@dataclass(frozen=True)
class EtcdMember:
    name: str
    data_dir: str
    host: str
    client_port: int
    peer_port: int
    # (name, peer URL) of every member of the cluster; empty: a cluster of this member alone.
    cluster: tuple[tuple[str, str], ...] = ()
    # Flags appended as they are (logging, TLS files, timeouts).
    extra: tuple[str, ...] = ()
    # "https" where `extra` gives the member a certificate for its clients.
    client_scheme: str = "http"

    @property
    def endpoint(self) -> str:
        return f"{self.client_scheme}://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def argv(self) -> list[str]:
        cluster = self.cluster or ((self.name, self.peer_url),)
        return [etcd_binary(), "--name", self.name, "--data-dir", self.data_dir,
                "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
                "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
                "--initial-cluster", ",".join(f"{name}={url}" for name, url in cluster), *self.extra]
