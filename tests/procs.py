"""Real processes for the tests: etcd, the launcher, single services. Output is kept for failures."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from services.mesh.discovery import InstanceInfo, component_prefix
from services.mesh.etcd_member import EtcdMember
from services.mesh.etcd_store import EtcdStore
from services.mesh.net import free_port
from services.mesh.tls import TlsConfig

ROOT = Path(__file__).resolve().parents[1]
MODEL = "kvmesh-demo"


class Proc:
    """A child whose merged output is collected line by line on a thread."""

    def __init__(self, argv: Sequence[str], name: str, env: dict[str, str] | None = None) -> None:
        self.name = name
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.popen = subprocess.Popen(
            list(argv), cwd=ROOT, env=full_env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
        )
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match[str]:
        """The first output line matching `pattern`; fails with the output tail if the child dies."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    if m := regex.search(line):
                        return m
                seen = len(self.lines)
                if self.popen.poll() is not None and not self._reader.is_alive():
                    raise RuntimeError(f"{self.name} exited ({self.popen.returncode}) before {pattern!r}:\n{self.tail()}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{self.name}: no {pattern!r} within {timeout_s}s:\n{self.tail()}")
                self._cond.wait(min(remaining, 0.5))

    def tail(self, n: int = 60) -> str:
        with self._cond:
            return "\n".join(self.lines[-n:])

    def terminate(self) -> None:
        """SIGTERM (the service drains); `stop` then waits for it."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 20) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self._reader.join(5)
        return self.popen.returncode

    def kill(self) -> None:
        self.popen.kill()
        self.popen.wait(10)


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


@dataclass
class Mesh:
    """A mesh started by `services.launch` against the test etcd, in its own namespace."""

    launcher: Proc
    base_url: str
    http_port: int
    etcd: str
    namespace: str
    model: str

    @classmethod
    def launch(cls, etcd: str, namespace: str, engine: str, *extra: str, timeout_s: float = 300) -> Mesh:
        port = free_port()
        if "--prefill-workers" not in extra:
            extra = ("--prefill-workers", "0", *extra)
        launcher = service("services.launch", "--engine", engine, "--etcd-endpoints", etcd, "--namespace", namespace,
                           "--http-port", str(port), *extra, name=f"launch-{namespace}")
        m = launcher.wait_for(r"^READY (\S+)", timeout_s)
        return cls(launcher, m.group(1), port, etcd, namespace, "kvmesh-demo")

    def stop(self) -> int:
        return self.launcher.stop(timeout_s=30)


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
    """Router, processor and frontend as separate processes; workers are added by the tests."""

    def __init__(self, etcd: str, router_mode: str = "kv", processor_flags: Sequence[str] = (),
                 processors: int = 1, frontend_flags: Sequence[str] = (), env: dict[str, str] | None = None,
                 router_flags: Sequence[str] = ()) -> None:
        """`env` is added to every process's environment, the workers' included."""
        self.etcd = etcd
        self.namespace = f"mesh-{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.env = env
        common = ["--etcd-endpoints", etcd, "--namespace", self.namespace]
        self.processors = [service("services.processor", *common, *processor_flags, name=f"processor-{i}", env=env)
                           for i in range(processors)]
        self.procs = [
            service("services.kv_router", *common, "--router-mode", router_mode, *router_flags, name="router", env=env),
            *self.processors,
            service("services.frontend", *common, "--http-port", str(self.port), *frontend_flags, name="frontend",
                    env=env),
        ]
        self.procs[-1].wait_for("listening on", 60)
        for processor in self.processors:
            processor.wait_for(r"processor \w+ for", 60)

    def worker(self, *extra: str) -> tuple[Proc, list[str]]:
        """A mocker decode worker process joining this mesh; returns it and its instance ids."""
        return self._worker("decode-worker", *extra)

    def prefill_worker(self, *extra: str) -> tuple[Proc, list[str]]:
        return self._worker("prefill-worker", *extra)

    def switchable_worker(self, start_as: str, *extra: str) -> tuple[Proc, list[str]]:
        """A mocker worker that can change role, registered first in `start_as`'s pool."""
        return self._worker("decode-worker", "--switchable", "--kv-transfer", "nixl", "--start-as", start_as, *extra,
                            ready_as=f"{start_as}-worker")

    def _worker(self, component: str, *extra: str, ready_as: str | None = None) -> tuple[Proc, list[str]]:
        proc = service(f"services.{component.replace('-', '_')}", "--etcd-endpoints", self.etcd,
                       "--namespace", self.namespace, "--engine", "mocker", "--speedup", "20", *extra, name=component,
                       env=self.env)
        self.procs.append(proc)  # before the wait: a worker that never gets ready is still stopped
        ids = proc.wait_for(rf"{ready_as or component} ready: (.+)$", 60).group(1).split()
        return proc, ids

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def complete(self, prompt: str | list[int] = "hello", max_tokens: int = 3) -> httpx.Response:
        return httpx.post(self.url("/v1/completions"), json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens},
                          timeout=30)

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
        self.procs[0] = service("services.kv_router", "--etcd-endpoints", self.etcd, "--namespace", self.namespace,
                                "--router-mode", router_mode, name="router", env=self.env)
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
