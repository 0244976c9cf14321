"""Real processes for the tests: etcd, the launcher, single services, a mesh of them. Output is
kept for failures. The mesh starter and `Proc` are bench/common/mesh_process.py's, shared with
the benchmarks."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from bench.common.mesh_process import READY, LaunchedMesh, Proc, service_argv
from services.mesh.discovery import (DECODE_WORKER, FRONTEND, PREFILL_WORKER, PROCESSOR, ROUTER, InstanceInfo,
                                     component_prefix)
from services.mesh.etcd_member import EtcdMember
from services.mesh.etcd_store import EtcdStore
from services.mesh.net import free_port
from services.mesh.tls import TlsConfig

ROOT = Path(__file__).resolve().parents[1]
MODEL = "kvmesh-demo"


@dataclass
class Etcd:
    proc: Proc
    endpoint: str
    data_dir: str
    client_port: int
    peer_port: int

    @classmethod
    def start(cls) -> Etcd:
        client, peer = free_port(), free_port()
        data = tempfile.mkdtemp(prefix="kvmesh-test-etcd-")
        return cls(_run_etcd(data, client, peer), f"http://127.0.0.1:{client}", data, client, peer)

    def halt(self) -> None:
        """Stops the server, keeping its data: `resume` brings the same cluster back."""
        self.proc.stop()

    def resume(self) -> None:
        self.proc = _run_etcd(self.data_dir, self.client_port, self.peer_port)

    def stop(self) -> None:
        self.proc.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)


def _run_etcd(data: str, client: int, peer: int) -> Proc:
    try:
        member = EtcdMember("t", data, "127.0.0.1", client, peer)
        proc = Proc(member.argv(), "etcd")
    except FileNotFoundError as exc:
        raise RuntimeError(str(exc)) from exc
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", client), 0.5).close()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.stop()
    raise RuntimeError("etcd did not start:\n" + proc.tail())


def service(module: str, *args: str, name: str | None = None, env: dict[str, str] | None = None) -> Proc:
    return Proc([sys.executable, "-m", module, *args], name or module, env)


class Mesh(LaunchedMesh):
    """A mesh started by `services.launch` against the test etcd, in its own namespace."""

    etcd: str = ""
    namespace: str = ""

    @classmethod
    def launch(cls, etcd: str, namespace: str, engine: str, *extra: str, timeout_s: float = 300) -> Mesh:
        mesh = cls.start("--engine", engine, "--etcd-endpoints", etcd, "--namespace", namespace, *extra,
                         timeout_s=timeout_s, log_level=None, name=f"launch-{namespace}")
        mesh.etcd, mesh.namespace = etcd, namespace
        return mesh


def wait_until(predicate, timeout_s: float, interval_s: float = 0.2) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return False


async def eventually(predicate, timeout_s: float, interval_s: float = 0.01) -> bool:  # noqa: ANN001
    """`wait_until` for a test on the event loop: polls without blocking the loop."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(interval_s)
    return False


def registered(etcd: str, namespace: str, component: str, tls: TlsConfig | None = None) -> list[InstanceInfo]:
    """The instances of a component registered in etcd right now."""

    async def fetch() -> list[InstanceInfo]:
        store = EtcdStore((etcd,), tls=tls)
        await store.connect()
        try:
            items, _ = await store.get_prefix(component_prefix(namespace, component))
            return [InstanceInfo.from_json(kv.value) for kv in items]
        finally:
            await store.close()

    return asyncio.run(fetch())


class ServiceMesh:
    """Router, processor and frontend as separate processes; workers are added by the tests.
    Stopped by `stop`, or at the end of a `with` block; a start that fails stops what it started."""

    def __init__(self, etcd: str, router_mode: str = "kv", processor_flags: Sequence[str] = (),
                 processors: int = 1, frontend_flags: Sequence[str] = (), env: dict[str, str] | None = None,
                 router_flags: Sequence[str] = (), flags: Sequence[str] = (), namespace: str | None = None) -> None:
        """`env` is added to every process's environment and `flags` to every command line, the
        workers' included."""
        self.etcd = etcd
        self.namespace = namespace or f"mesh-{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.env = env
        self.flags = tuple(flags)
        self.procs: list[Proc] = []
        try:
            self.procs.append(self._start(ROUTER, "--router-mode", router_mode, *router_flags, name="router"))
            self.processors = [self._start(PROCESSOR, *processor_flags, name=f"processor-{i}")
                               for i in range(processors)]
            self.procs += self.processors
            self.procs.append(self._start(FRONTEND, "--http-port", str(self.port), *frontend_flags, name="frontend"))
            self.procs[-1].wait_for(READY[FRONTEND], 60)
            for processor in self.processors:
                processor.wait_for(READY[PROCESSOR], 60)
        except BaseException:
            self.stop()
            raise

    def __enter__(self) -> ServiceMesh:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _start(self, component: str, *flags: str, name: str) -> Proc:
        return Proc(service_argv(component, self.etcd, self.namespace, *self.flags, *flags), name, self.env)

    def worker(self, *extra: str) -> tuple[Proc, list[str]]:
        """A mocker decode worker process joining this mesh; returns it and its instance ids."""
        return self._worker(DECODE_WORKER, *extra)

    def prefill_worker(self, *extra: str) -> tuple[Proc, list[str]]:
        return self._worker(PREFILL_WORKER, *extra)

    def switchable_worker(self, start_as: str, *extra: str) -> tuple[Proc, list[str]]:
        """A mocker worker that can change role, registered first in `start_as`'s pool."""
        return self._worker(DECODE_WORKER, "--switchable", "--kv-transfer", "nixl", "--start-as", start_as, *extra,
                            ready_as=f"{start_as}-worker")

    def _worker(self, component: str, *extra: str, ready_as: str | None = None) -> tuple[Proc, list[str]]:
        proc = self._start(component, "--engine", "mocker", "--speedup", "20", *extra, name=component)
        self.procs.append(proc)  # before the wait: a worker that never gets ready is still stopped
        ids = proc.wait_for(READY[ready_as or component], 60).group(1).split()
        return proc, ids

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def complete(self, prompt: str | list[int] = "hello", max_tokens: int = 3,
                 headers: dict[str, str] | None = None) -> httpx.Response:
        return httpx.post(self.url("/v1/completions"), json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens},
                          headers=headers, timeout=30)

    def find_matches(self, token_ids: list[int]) -> dict[str, int]:
        return find_matches(self.etcd, self.namespace, token_ids)

    def metrics(self, component: str) -> str:
        """The Prometheus text of the (first) registered instance of a component."""
        (info, *_) = registered(self.etcd, self.namespace, component)
        return httpx.get(f"http://127.0.0.1:{info.metrics_port}/metrics", timeout=10).text

    def restart_router(self, router_mode: str = "kv") -> None:
        old = self.procs[0]
        old_ids = {i.instance_id for i in registered(self.etcd, self.namespace, "kv-router")}
        assert old.stop() == 0, old.tail()
        self.procs[0] = self._start(ROUTER, "--router-mode", router_mode, name="router")
        assert wait_until(lambda: {i.instance_id for i in registered(self.etcd, self.namespace, "kv-router")} - old_ids
                          and not old_ids & {i.instance_id for i in registered(self.etcd, self.namespace, "kv-router")},
                          30)

    def stop(self) -> None:
        # All at once: each drain waits out a propagation delay, which need not add up.
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in reversed(self.procs):
            proc.stop()


def find_matches(etcd: str, namespace: str, token_ids: list[int], model: str = MODEL) -> dict[str, int]:
    """Asks the mesh's router (over gRPC, as any client could) which workers cache these tokens."""
    return find_matches_by_tier(etcd, namespace, token_ids, model)[0]


def find_matches_by_tier(etcd: str, namespace: str, token_ids: list[int],
                         model: str = MODEL) -> tuple[dict[str, int], dict[str, int]]:
    """The router's scores per worker: device-held prompt blocks, and host-memory-only ones."""
    import grpc

    from gen.kvmesh.v1 import router_pb2, router_pb2_grpc

    (router,) = registered(etcd, namespace, "kv-router")
    with grpc.insecure_channel(router.address) as channel:
        reply = router_pb2_grpc.RouterStub(channel).FindMatches(
            router_pb2.FindMatchesRequest(model=model, token_ids=token_ids), timeout=10)
    return dict(reply.scores), dict(reply.host_scores)




@dataclass
class EtcdCluster:
    """Three etcd members on loopback, one raft cluster: for failover between endpoints."""

    members: list[Proc]
    endpoints: list[str]
    data_dirs: list[str]

    @classmethod
    def start(cls, size: int = 3) -> EtcdCluster:
        specs = [EtcdMember(f"m{i}", tempfile.mkdtemp(prefix=f"kvmesh-test-etcd-m{i}-"), "127.0.0.1", free_port(),
                            free_port(), extra=("--initial-cluster-state", "new")) for i in range(size)]
        cluster = tuple((m.name, m.peer_url) for m in specs)
        try:
            members = [Proc(replace(m, cluster=cluster).argv(), f"etcd-{m.name}") for m in specs]
        except FileNotFoundError as exc:
            raise RuntimeError(str(exc)) from exc
        out = cls(members, [m.endpoint for m in specs], [m.data_dir for m in specs])
        etcdctl = shutil.which("etcdctl")
        env = {**os.environ, "ETCDCTL_API": "3"}
        healthy = wait_until(lambda: etcdctl is not None and subprocess.run(
            [etcdctl, "--endpoints", ",".join(out.endpoints), "endpoint", "health"], env=env,
            capture_output=True, timeout=10).returncode == 0, 30)
        if not healthy:
            out.stop()
            raise RuntimeError("the etcd cluster did not become healthy")
        return out

    def stop(self) -> None:
        for member in self.members:
            member.stop()
        for d in self.data_dirs:
            shutil.rmtree(d, ignore_errors=True)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State:"))
    except (OSError, StopIteration):
        return False
    return "zombie" not in state


def engine_processes(worker_pid: int) -> set[int]:
    """A vLLM worker's engine processes: its descendants but the reaper it started beside them."""
    from services.worker.reaper import descendants

    return {p for p in descendants(worker_pid) if "reaper" not in _cmdline(p)}
