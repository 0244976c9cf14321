"""One rolling restart of the decode pool under load, and what it leaves to read.

Every decode worker running at the start is replaced in turn: a replacement is started and
waited for (registered: routers may choose it), the old worker's /metrics are read (they go
with it), it gets SIGTERM and is waited for (`EXIT_LIMIT_S`, then SIGKILL). Its drain line and
the processor's lines about the requests it gave up are read from their logs afterwards.

The KV pulls of the moves are counted on the destinations: every worker's histogram at the
start of the roll, each old worker's right before its SIGTERM (after the moves into it from the
workers rolled before), each replacement's at the end; the difference is the roll's.
"""

from __future__ import annotations

import asyncio
import datetime
import re
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.samples import Sample

from bench.moves.mesh import DrainMode, MovesMesh, Worker
from testkit import metrics
from testkit.proc import Proc

# A drain waits for its streams at most this long (the wait mode's streams finish in seconds).
EXIT_LIMIT_S = 60.0
DRAIN_LINE = re.compile(r"drain of (\S+): (\d+) requests handed over in ([\d.]+)s")
# The processor's line for each request a worker gave up: handed over (a move), failed after
# its first token (a migration) or before it (a retry).
GAVE_UP = re.compile(r"^(\S+ \S+) .*request (\S+): worker (\S+) (?:handed it over|failed after|failed before)")
LOG_TIME = "%Y-%m-%d %H:%M:%S,%f"
TRANSFER = "kvmesh_kv_transfer_duration_seconds"


@dataclass
class Rolled:
    """One old worker's end. Times are time.perf_counter() readings, as the clients' are."""

    worker_id: str
    terminated_at: float
    exited_at: float
    exit_code: int | None
    # From its drain line (move mode only): requests handed over, and how long that took.
    handed_over: int | None = None
    handover_s: float | None = None
    # Requests known to have been on it (by the id their client saw), beside the x-kvmesh-worker
    # header: those the processor says it gave up (moved, migrated or retried elsewhere), read by
    # `Roll.attribute` once the load has ended; Dynamo's, those its router sent it.
    served: set[str] = field(default_factory=set)
    # When the processor logged that the worker gave each request up (kvmesh only), on the
    # clients' clock: the next chunk's wait from there is the move's own (or the recompute's).
    gave_up_at: dict[str, float] = field(default_factory=dict)

    @property
    def exit_s(self) -> float:
        return self.exited_at - self.terminated_at


@dataclass
class KvPulls:
    """The KV pulled by the destinations during a roll: duration buckets {le: count}, bytes,
    and moved-in requests by whether their KV was pulled or recomputed."""

    buckets: dict[float, float] = field(default_factory=dict)
    bytes: float = 0.0
    moved_in: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, samples: list[Sample]) -> KvPulls:
        buckets = {float(s.labels["le"]): s.value for s in metrics.matching(samples, TRANSFER + "_bucket")}
        moved = {k: v for (k,), v in metrics.by_labels(samples, "kvmesh_decode_moved_in_total", "kv").items()}
        return cls(buckets, metrics.total(samples, "kvmesh_kv_transfer_bytes_total"), moved)

    def __add__(self, other: KvPulls) -> KvPulls:
        return KvPulls(_merge(self.buckets, other.buckets, 1), self.bytes + other.bytes,
                       _merge(self.moved_in, other.moved_in, 1))

    def __sub__(self, other: KvPulls) -> KvPulls:
        return KvPulls(_merge(self.buckets, other.buckets, -1), self.bytes - other.bytes,
                       _merge(self.moved_in, other.moved_in, -1))


def _merge(a: dict[Any, float], b: dict[Any, float], sign: int) -> dict[Any, float]:
    return {k: a.get(k, 0.0) + sign * b.get(k, 0.0) for k in a.keys() | b.keys()}


@dataclass
class Roll:
    started_at: float
    ended_at: float
    rolled: list[Rolled]
    pulls: KvPulls
    # The lines of the log requests are routed by before the roll: the processor's (Dynamo: its
    # frontend's).
    log_mark: int

    def attribute(self, processor_lines: list[str]) -> None:
        """Each rolled worker's `served`, from the processor's lines since the roll began."""
        by_id = {r.worker_id: r for r in self.rolled}
        # The log's wall-clock times (local, to the millisecond) on the perf_counter clock.
        offset = time.time() - time.perf_counter()
        for line in processor_lines[self.log_mark:]:
            if (m := GAVE_UP.search(line)) and (done := by_id.get(m.group(3))) is not None:
                done.served.add(m.group(2))
                wall = datetime.datetime.strptime(m.group(1), LOG_TIME).timestamp()
                done.gave_up_at.setdefault(m.group(2), wall - offset)


async def roll(mesh: MovesMesh, replacement_mode: DrainMode) -> Roll:
    """Replaces every live decode worker, one by one (replacements started with
    `replacement_mode`: the next run's, so one mesh serves every run)."""
    started_at = time.perf_counter()
    mark = len(mesh.processor_lines())
    old = mesh.live_workers()
    before = {w.instance_id: KvPulls.of(await mesh.worker_samples(w)) for w in old}
    rolled, last = [], {}
    for worker in old:
        await mesh.start_worker(replacement_mode)
        last[worker.instance_id] = KvPulls.of(await mesh.worker_samples(worker))
        rolled.append(await _drain(worker))
    for worker in mesh.live_workers():
        last[worker.instance_id] = KvPulls.of(await mesh.worker_samples(worker))
    pulls = KvPulls()
    for worker_id, pulled in last.items():
        pulls = pulls + (pulled - before.get(worker_id, KvPulls()))
    return Roll(started_at, time.perf_counter(), rolled, pulls, mark)


async def terminated(proc: Proc, instance_id: str) -> Rolled:
    """SIGTERM, and the wait for the exit (SIGKILL past `EXIT_LIMIT_S`). Waited for on a thread:
    the exit is timed to the millisecond, not to a polling interval."""
    proc.signalled = "SIGTERM"
    terminated_at = time.perf_counter()
    proc.terminate()
    try:
        code: int | None = await asyncio.to_thread(proc.popen.wait, EXIT_LIMIT_S)
    except subprocess.TimeoutExpired:
        code = None
    exited_at = time.perf_counter()
    if code is None:
        code = await proc.stop_async(10)
    return Rolled(instance_id, terminated_at, exited_at, code)


async def _drain(worker: Worker) -> Rolled:
    """`terminated`, and what the worker's drain line says."""
    done = await terminated(worker.proc, worker.instance_id)
    for line in worker.proc.lines:
        if m := DRAIN_LINE.search(line):
            done.handed_over, done.handover_s = int(m.group(2)), float(m.group(3))
    return done
