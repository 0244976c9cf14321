"""Real processes for the tests: etcd, the launcher, single services, a mesh of them. Output is
kept for failures. `Proc`, the etcd starter and the mesh starter are the test kit's (testkit/),
shared with the benchmarks; what only the tests start is here."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence

import httpx

from services.mesh.discovery import DECODE_WORKER, FRONTEND, PREFILL_WORKER, PROCESSOR, ROUTER
from services.mesh.net import free_port
from testkit.etcd import Etcd as Etcd
from testkit.mesh import READY, LaunchedMesh, registered, service_argv
from testkit.metrics import metrics_url
from testkit.proc import ROOT as ROOT
from testkit.proc import Proc, python_module
from testkit.proc_stat import argv, running
from testkit.sse import MODEL as MODEL


def service(module: str, *args: str, name: str | None = None, env: dict[str, str] | None = None) -> Proc:
    return Proc(python_module(module, *args), name or module, env)


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
        return httpx.get(metrics_url(info.metrics_port), timeout=10).text

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


# Whether a pid runs (a zombie does not): /proc's word, under the tests' name.
alive = running


def engine_processes(worker_pid: int) -> set[int]:
    """A vLLM worker's engine processes: its descendants but the reaper it started beside them."""
    from services.worker.reaper import descendants

    return {p for p in descendants(worker_pid) if "reaper" not in " ".join(argv(p))}
