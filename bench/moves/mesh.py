"""The moves run's mesh: etcd, one kv-router, one processor, one frontend and mocker decode
workers, each its own process with its output in a log file of the run directory, so a rolled
worker's drain line ("drain of <id>: N requests handed over in X.XXs") can be read after it exited.

Decode workers are the part that changes: `start_worker` starts one with a drain mode's flags
(the roll starts a replacement before it stops the old one), `worker_samples` reads a worker's
/metrics (on a port chosen here, so it is known without asking etcd), and `stop` ends everything.
etcd, each service's command line and the line it prints once it serves are the test kit's.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.samples import Sample

from services.mesh.discovery import DECODE_WORKER, FRONTEND, PROCESSOR, ROUTER
from services.mesh.net import free_port
from testkit import metrics
from testkit.etcd import Etcd
from testkit.mesh import READY, service_argv
from testkit.proc import Proc

READY_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 20.0

# The mocker's default timing (h100-8b) prefills a 64k-token prompt in 21 s and decodes a step in
# 12 ms; divided by 8, a 64k prompt takes 2.6 s (an 8k one 0.1 s) and a step 1.5 ms.
SPEEDUP = 8.0
KV_BYTES_PER_TOKEN = 1024  # 64 MiB for a 64k-token context: four fit the 256 MiB NIXL arena
MAX_MODEL_LEN = 70_000  # 64k prompt + a few hundred tokens out
NUM_GPU_BLOCKS = 65_536  # 1M tokens of 16: a dozen 64k contexts, moved-in ones included


@dataclass(frozen=True)
class DrainMode:
    """How a rolled worker drains: its flags, and the name the tables use."""

    name: str
    flags: tuple[str, ...]


@dataclass
class Worker:
    """A decode worker process; `instance_id` from its ready line."""

    proc: Proc
    metrics_port: int
    mode: DrainMode
    instance_id: str = ""


class MovesMesh:
    """Every process of the run; `workers` the decode workers started, in order, dead or alive."""

    def __init__(self, run_dir: Path, namespace: str) -> None:
        self.run_dir = run_dir
        self.namespace = namespace
        self.etcd = Etcd(data_dir=run_dir / "etcd-data", log_dir=run_dir)
        self.http_port = free_port()
        self.processor_metrics_port = free_port()
        self.services: list[Proc] = []
        self.workers: list[Worker] = []

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def _spawn(self, name: str, role: str, *flags: str) -> Proc:
        argv = service_argv(role, self.etcd.endpoint, self.namespace, *flags)
        return Proc(argv, name, log=self.run_dir / f"{name}.log", role=role)

    async def _ready(self, proc: Proc) -> str:
        """The instance id(s) the process announces once it serves."""
        return (await proc.wait_for_async(READY[proc.role], READY_TIMEOUT_S)).group(1)

    async def start(self, modes: Sequence[DrainMode]) -> None:
        """etcd, then the router, the processor and one worker per entry of `modes` at once (2
        cores: one by one would take a minute), the frontend last once they serve."""
        await self.etcd.serve_async()
        self.services += [self._spawn("kv-router", ROUTER, "--router-mode", "kv"),
                          self._spawn("processor", PROCESSOR, "--metrics-port", str(self.processor_metrics_port))]
        workers = [self._spawn_worker(mode) for mode in modes]
        await asyncio.gather(*(self._ready(p) for p in self.services), *(self._until_ready(w) for w in workers))
        frontend = self._spawn("frontend", FRONTEND, "--http-port", str(self.http_port))
        self.services.append(frontend)
        await self._ready(frontend)

    def _spawn_worker(self, mode: DrainMode) -> Worker:
        port = free_port()
        flags = ["--engine", "mocker", "--kv-transfer", "nixl", "--no-remote-prefill", "--speedup", f"{SPEEDUP:g}",
                 "--kv-bytes-per-token", str(KV_BYTES_PER_TOKEN), "--max-model-len", str(MAX_MODEL_LEN),
                 "--num-gpu-blocks", str(NUM_GPU_BLOCKS), "--metrics-port", str(port), *mode.flags]
        worker = Worker(self._spawn(f"decode-worker-{len(self.workers) + 1}", DECODE_WORKER, *flags), port, mode)
        self.workers.append(worker)
        return worker

    async def _until_ready(self, worker: Worker) -> Worker:
        worker.instance_id = await self._ready(worker.proc)
        return worker

    async def start_worker(self, mode: DrainMode) -> Worker:
        """One more decode worker, once it serves (registered in etcd: routers may choose it)."""
        return await self._until_ready(self._spawn_worker(mode))

    def live_workers(self) -> list[Worker]:
        return [w for w in self.workers if w.proc.alive and not w.proc.signalled]

    async def worker_samples(self, worker: Worker) -> list[Sample]:
        """The worker's /metrics now, read off the event loop: the clients' chunk timestamps are
        taken on it."""
        return await asyncio.to_thread(metrics.scrape, metrics.metrics_url(worker.metrics_port), 5)

    async def processor_samples(self) -> list[Sample]:
        return await asyncio.to_thread(metrics.scrape, metrics.metrics_url(self.processor_metrics_port), 5)

    def processor_lines(self, after: int = 0) -> list[str]:
        """The processor's log lines from index `after` on (its handoff and migration lines)."""
        return self.services[1].lines[after:]

    def alive(self) -> list[Proc]:
        return [p for p in (*self.services, *(w.proc for w in self.workers), *self.etcd.procs) if p.alive]

    async def stop(self) -> None:
        """SIGTERM to every worker and service at once (a wait-mode worker finishes its streams
        first, and none is left once the load has stopped), SIGKILL what outlives the timeout;
        then etcd, whose data goes (its preallocated WAL alone is 64 MB)."""
        running = [p for p in (*(w.proc for w in self.workers), *reversed(self.services)) if p.alive]
        await asyncio.gather(*(p.stop_async(STOP_TIMEOUT_S) for p in running))
        await self.etcd.stop_async(10)
        shutil.rmtree(self.etcd.data_dir, ignore_errors=True)
