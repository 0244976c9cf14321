"""An embedded etcd for a local mesh: a child on free loopback ports with a throw-away data dir."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

from services.launch.children import Child
from services.launch.console import Console
from services.mesh.etcd_member import EtcdMember
from services.mesh.net import accepts_connections, free_port


class EtcdChild:
    def __init__(self, host: str = "127.0.0.1", console: Console | None = None, log_path: Path | None = None) -> None:
        self.member = EtcdMember(
            "kvmesh", tempfile.mkdtemp(prefix="kvmesh-etcd-"), host, free_port(host), free_port(host),
            # zap: one JSON object per line with its level, which the console filter reads
            # (etcd 3.4's default logger writes raft's INFO chatter whatever the level).
            extra=("--logger", "zap", "--log-level", "warn"))
        self.endpoint = self.member.endpoint
        self.child = Child("etcd", self.member.argv(), log_path=log_path, console=console or Console())

    async def start(self, timeout_s: float = 20.0) -> None:
        await self.child.start()
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            if self.child.returncode is not None:
                where = f" (its log: {self.child.log_path})" if self.child.log_path else ""
                raise RuntimeError(f"etcd exited at start-up{where}:\n" + "\n".join(self.child.tail))
            if await accepts_connections(self.member.host, self.member.client_port):
                self.child.mark_ready()
                return
            await asyncio.sleep(0.1)
        raise TimeoutError(f"etcd did not listen on {self.endpoint} within {timeout_s:.0f}s")

    async def stop(self) -> None:
        await self.child.stop()
        shutil.rmtree(self.member.data_dir, ignore_errors=True)

