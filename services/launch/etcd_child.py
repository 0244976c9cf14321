"""An embedded etcd for a local mesh: a child on free loopback ports with a throw-away data dir."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

from services.launch.children import Child
from services.launch.console import Console
from services.mesh.net import free_port


def etcd_binary() -> str:
    path = shutil.which("etcd")
    if path is None:
        raise FileNotFoundError("etcd is not installed (run `make install`, or `apt-get install etcd-server`)")
    return path


class EtcdChild:
    def __init__(self, host: str = "127.0.0.1", console: Console | None = None, log_path: Path | None = None) -> None:
        self.host = host
        self.client_port = free_port(host)
        self.peer_port = free_port(host)
        self.data_dir = tempfile.mkdtemp(prefix="kvmesh-etcd-")
        self.endpoint = f"http://{host}:{self.client_port}"
        self.child = Child("etcd", [
            etcd_binary(),
            "--name", "kvmesh",
            "--data-dir", self.data_dir,
            "--listen-client-urls", self.endpoint,
            "--advertise-client-urls", self.endpoint,
            "--listen-peer-urls", f"http://{host}:{self.peer_port}",
            "--initial-advertise-peer-urls", f"http://{host}:{self.peer_port}",
            "--initial-cluster", f"kvmesh=http://{host}:{self.peer_port}",
            # zap: one JSON object per line with its level, which the console filter reads
            # (etcd 3.4's default logger writes raft's INFO chatter whatever the level).
            "--logger", "zap",
            "--log-level", "warn",
        ], log_path=log_path, console=console or Console())

    async def start(self, timeout_s: float = 20.0) -> None:
        await self.child.start()
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            if self.child.returncode is not None:
                where = f" (its log: {self.child.log_path})" if self.child.log_path else ""
                raise RuntimeError(f"etcd exited at start-up{where}:\n" + "\n".join(self.child.tail))
            if await _port_open(self.host, self.client_port):
                self.child.mark_ready()
                return
            await asyncio.sleep(0.1)
        raise TimeoutError(f"etcd did not listen on {self.endpoint} within {timeout_s:.0f}s")

    async def stop(self) -> None:
        await self.child.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)


async def _port_open(host: str, port: int) -> bool:
    try:
        _reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 1.0)
    except (TimeoutError, OSError):
        return False
    writer.close()
    return True
