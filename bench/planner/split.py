"""The prefill:decode split of a running mesh over time, read from etcd, and the planner's decisions
read from its log (the launcher's run directory has planner.log, one "plan ..." line per decision).

The split is what the routers see: the workers registered in each pool, those marked leaving
(a switch moves a worker's record to the other pool at once, marked so first) not counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.mesh.discovery import DECODE_WORKER, PREFILL_WORKER, InstanceInfo, component_prefix
from services.mesh.etcd_store import EtcdStore
from testkit.proc_stat import argv as proc_argv

# Each etcd read has a deadline of its own (EtcdStore's call timeout, a few seconds).
SAMPLE_TIMEOUT_S = 3


def etcd_endpoint(etcd_pid: int) -> str:
    """The client URL of the launcher's embedded etcd, from that process's command line."""
    argv = proc_argv(etcd_pid)
    return argv[argv.index("--advertise-client-urls") + 1]


@dataclass
class SplitSampler:
    """Samples (seconds since `start`, prefill workers, decode workers) every `period_s`."""

    endpoint: str
    namespace: str
    period_s: float = 1.0
    samples: list[tuple[float, int, int]] = field(default_factory=list)
    # Wall-clock time of the start, to place the planner's log lines on the same timeline.
    started_wall: float = 0.0
    _store: EtcdStore | None = None
    _task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._store = EtcdStore((self.endpoint,), timeout_s=SAMPLE_TIMEOUT_S)
        await self._store.connect()
        self.started_wall = time.time()
        self._task = asyncio.create_task(self._loop(time.perf_counter()), name="split-sampler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._store is not None:
            await self._store.close()

    async def _loop(self, started: float) -> None:
        while True:
            at = time.perf_counter() - started
            try:
                # One after the other: both counts from (nearly) the same moment, nothing to cancel midway.
                self.samples.append((at, await self._count(PREFILL_WORKER), await self._count(DECODE_WORKER)))
            except Exception:  # noqa: BLE001 - etcd busy for a moment: a gap in the timeline, not a failed run
                pass
            await asyncio.sleep(max(0.0, started + at + self.period_s - time.perf_counter()))

    async def _count(self, component: str) -> int:
        assert self._store is not None
        items, _ = await self._store.get_prefix(component_prefix(self.namespace, component))
        return sum(1 for kv in items if not InstanceInfo.from_json(kv.value).leaving)


_PLAN = re.compile(r"plan (\d+)P:(\d+)D -> (\d+)P:(\d+)D \(([^)]*)\)")
_SECONDS = r"(-|[0-9.]+s|inf s|infs)"
_LATENCIES = re.compile(rf"TTFT {_SECONDS} ITL {_SECONDS} observed, {_SECONDS} / {_SECONDS} modelled")
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


@dataclass(frozen=True)
class PlanLine:
    current: tuple[int, int]
    desired: tuple[int, int]
    reason: str
    text: str
    # Wall-clock time of the decision (NaN where the line had no timestamp).
    at_wall: float = float("nan")
    # The interval's mean TTFT and ITL as observed, and as the model said at the sizes it had
    # (None where the line has none: no traffic, or an older planner's line).
    observed: tuple[float | None, float | None] = (None, None)
    modelled: tuple[float | None, float | None] = (None, None)

    @property
    def changes(self) -> bool:
        return self.current != self.desired


def plan_lines(run_dir: Path) -> list[PlanLine]:
    """The planner's decisions in order (empty if it logged none)."""
    path = run_dir / "planner.log"
    if not path.exists():
        return []
    lines = []
    for text in path.read_text(errors="replace").splitlines():
        if m := _PLAN.search(text):
            p0, d0, p1, d1 = (int(g) for g in m.groups()[:4])
            stamp = _STAMP.match(text)
            at = time.mktime(time.strptime(stamp.group(1)[:19], "%Y-%m-%d %H:%M:%S")) + \
                int(stamp.group(1)[20:]) / 1000 if stamp else float("nan")
            lat = _LATENCIES.search(text)
            values = [_seconds(v) for v in lat.groups()] if lat else [None] * 4
            lines.append(PlanLine((p0, d0), (p1, d1), m.group(5), text[m.start():], at,
                                  (values[0], values[1]), (values[2], values[3])))
    return lines


def _seconds(text: str) -> float | None:
    if text == "-":
        return None
    return float(text.rstrip("s").strip())


def warnings_of(run_dir: Path, limit: int = 1000) -> list[str]:
    """WARNING and ERROR lines of every log in the run directory (the first `limit`)."""
    found: list[str] = []
    for path in sorted(run_dir.glob("*.log")):
        for text in path.read_text(errors="replace").splitlines():
            if re.search(r"\b(WARNING|ERROR|CRITICAL|Traceback)\b", text):
                found.append(f"{path.name}: {text[:300]}")
                if len(found) >= limit:
                    return found
    return found
