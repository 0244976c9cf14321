"""NVIDIA Dynamo 1.6.1's rolling restart, the baseline from outside kvmesh: its frontend (KV router,
`--migration-limit 3`: a request whose worker stream breaks is re-prefilled on another worker)
and 3 `dynamo.mocker` processes of one worker each, against an etcd of its own; the roll starts
a replacement mocker, waits for it to register, SIGTERMs an old one and waits for its exit.

Seen here: a SIGTERMed Dynamo mocker stops taking requests and waits for its streams to end
(its runtime's graceful shutdown), so the roll is a drain by waiting; nothing is migrated
unless a stream breaks.

Its mocker's timing model is not kvmesh's: `--speedup-ratio 0.55 --decode-speedup-ratio 11`
give the same 64k-token TTFT (about 2.5 s) and about the same decode step (1.3 ms) as kvmesh's
mocker at speedup 8, measured on this machine. Its prefill is chunked (8192 tokens a step), so
a long prompt delays the other streams of its worker by a chunk's time per step, where kvmesh's
mocker runs a long prompt whole in one step.

Which worker served a stream is read from its frontend's log (the client sends its own
x-request-id, which Dynamo logs beside its own request id and, in the router's line, the
worker's id); Dynamo exports no counter of recomputed tokens, so that row stays empty for it.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import time
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from bench.common.side_venv import Unavailable
from bench.hot_path import dynamo
from bench.moves.roll import KvPulls, Roll, terminated
from services.mesh.net import free_port
from services.tools.make_demo_model import ensure_demo_model
from testkit.etcd import Etcd
from testkit.proc import Proc, ProcFailed

NAME = "Dynamo 1.6.1"
NOTE = "drains by waiting: the SIGTERMed mocker finishes its streams"
SPEEDUP, DECODE_SPEEDUP = 0.55, 11.0
READY_TIMEOUT_S = 60.0
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# A mocker's id, once its generate endpoint is registered and its KV events are published.
MOCKER_READY = r"KvEventPublisher for worker (\d+)"
# The frontend's lines: its request id beside the client's, then the worker its router chose.
RECEIVED = re.compile(r'request received request_id=(\S+) .*x_request_id="([^"]+)"')
SELECTED = re.compile(r'Selected worker .*request_id="([^"]+)" worker_id=(\d+)')
COMMON = ["--discovery-backend", "etcd", "--request-plane", "tcp", "--event-plane", "zmq"]


class DynamoPool:
    """Dynamo's frontend and its mocker processes (`mockers`: every one started, in order)."""

    def __init__(self, run_dir: Path, interpreter: Path, etcd: Etcd) -> None:
        self.run_dir = run_dir
        self.interpreter = interpreter
        self.env = {"ETCD_ENDPOINTS": etcd.endpoint, "NO_COLOR": "1"}
        self.port = free_port()
        self.frontend: Proc | None = None
        self.mockers: list[Proc] = []

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _proc(self, name: str, *args: str) -> Proc:
        return Proc([str(self.interpreter), "-m", *args, *COMMON], name, self.env, log=self.run_dir / f"{name}.log",
                    group=True)

    async def start(self, workers: int) -> None:
        self.frontend = self._proc("dynamo-frontend", "dynamo.frontend", "--http-port", str(self.port),
                                   "--router-mode", "kv", "--migration-limit", "3")
        await asyncio.gather(*(self.start_mocker() for _ in range(workers)))
        await asyncio.to_thread(self._wait_for_model)

    async def start_mocker(self) -> Proc:
        """One more mocker, once it is registered (its id in `ids`)."""
        proc = self._proc(f"dynamo-mocker-{len(self.mockers) + 1}", "dynamo.mocker", "--model-path",
                          str(ensure_demo_model()), "--model-name", "kvmesh-demo", "--num-workers", "1",
                          "--block-size", "16", "--num-gpu-blocks-override", "65536", "--max-model-len", "70000",
                          "--speedup-ratio", f"{SPEEDUP:g}", "--decode-speedup-ratio", f"{DECODE_SPEEDUP:g}",
                          "--enable-prefix-caching")
        self.mockers.append(proc)
        try:
            proc.ids = [(await proc.wait_for_async(MOCKER_READY, READY_TIMEOUT_S)).group(1)]
        except ProcFailed as exc:
            raise Unavailable(f"a Dynamo mocker did not start: {str(exc)[-300:]}") from exc
        return proc

    def _wait_for_model(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=2) as reply:
                    if b"kvmesh-demo" in reply.read():
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise Unavailable(f"Dynamo's frontend did not list the model within {READY_TIMEOUT_S:g}s")

    async def roll(self) -> Roll:
        """Each mocker running now replaced: a new one registered, then SIGTERM to the old one and
        the wait for its exit (SIGKILL past `EXIT_LIMIT_S`)."""
        started_at = time.perf_counter()
        mark = len(self.frontend_lines())
        rolled = []
        for old in [m for m in self.mockers if m.alive]:
            await self.start_mocker()
            rolled.append(await terminated(old, old.ids[0]))
        return Roll(started_at, time.perf_counter(), rolled, KvPulls(), mark)

    def frontend_lines(self) -> list[str]:
        assert self.frontend is not None
        return self.frontend.lines

    def attribute(self, roll: Roll) -> float:
        """Each rolled mocker's `served`: the client ids of the requests the router sent it.
        Returns the requests the router chose a worker for again since the roll began (its
        migrations and retries: Dynamo counts neither where it can be read)."""
        client_of, by_worker = {}, {r.worker_id: r for r in roll.rolled}
        routed: dict[str, int] = {}
        for i, raw in enumerate(self.frontend_lines()):
            line = ANSI.sub("", raw)
            if m := RECEIVED.search(line):
                client_of[m.group(1)] = m.group(2)
            elif m := SELECTED.search(line):
                if i >= roll.log_mark:
                    routed[m.group(1)] = routed.get(m.group(1), 0) + 1
                if (done := by_worker.get(m.group(2))) is not None:
                    done.served.add(client_of.get(m.group(1), ""))
        return float(sum(n - 1 for n in routed.values()))

    async def stop(self) -> None:
        procs = [p for p in (*self.mockers, self.frontend) if p is not None and p.alive]
        await asyncio.gather(*(p.stop_async(20) for p in procs))


@asynccontextmanager
async def serving(run_dir: Path, workers: int) -> AsyncIterator[DynamoPool]:
    """Dynamo's frontend and `workers` mockers on an etcd of their own; Unavailable where the
    baseline cannot be installed or started."""
    interpreter = await asyncio.to_thread(dynamo.python)
    etcd = Etcd(data_dir=run_dir / "dynamo-etcd-data", log_dir=run_dir, name="dynamo-etcd",
                extra=("--log-level", "error", "--logger", "zap"))
    try:
        await etcd.serve_async()
    except ProcFailed as exc:
        await etcd.stop_async(10)
        raise Unavailable(f"etcd: {str(exc).splitlines()[0]}") from exc
    pool = DynamoPool(run_dir, interpreter, etcd)
    try:
        await pool.start(workers)
        yield pool
    finally:
        await pool.stop()
        await etcd.stop_async(10)
        shutil.rmtree(etcd.data_dir, ignore_errors=True)
