"""The chaos run's fault schedule: what is done to the mesh, and when.

`plan` turns the seed into an order and start times spread over the load window (10 %..85 % of
the run), the etcd outage taking its length out of the gaps. `FaultRunner` carries it out:

- kill-decode / kill-prefill / kill-processor / kill-router: SIGKILL one running instance and
  start a replacement at once (a crash and the orchestrator's restart);
- roll-decode: SIGTERM one decode worker (it drains, handing its running requests over to the
  others with their KV: `--drain-mode move`) and start its replacement beside it (a rolling
  update);
- etcd-outage: stop etcd for the outage length and start it again on the same ports and data dir.

A decode-worker victim is the one streaming the most requests right now (ties broken by the
seeded generator), so the fault lands mid-stream; other victims come from the seeded generator.
Replacements are awaited in the background, so a slow start does not push every later fault
back; before the etcd outage every pending replacement must be serving (a process cannot join a
mesh whose etcd is down).
"""

from __future__ import annotations

import asyncio
import random
import re
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from bench.chaos.mesh import DECODE, PREFILL, PROCESSOR, ROUTER, ChaosMesh
from testkit.proc import Proc, ProcFailed

KILLS = {"kill-decode": DECODE, "kill-prefill": PREFILL, "kill-processor": PROCESSOR, "kill-router": ROUTER}
ROLL, OUTAGE = "roll-decode", "etcd-outage"
FAULT_KINDS = (*KILLS, ROLL, OUTAGE)
WINDOW = (0.10, 0.85)


@dataclass
class Fault:
    kind: str
    planned_s: float
    started_s: float | None = None
    ended_s: float | None = None  # the replacement serves / etcd answers again
    victim: str = ""
    replacement: str = ""
    note: str = ""
    ok: bool = True

    def fail(self, why: str) -> None:
        self.ok = False
        self.note = f"{self.note}; {why}" if self.note else why


def plan(seed: int, duration_s: float, outage_s: float) -> list[Fault]:
    """Each fault once, in a seeded order, at seeded times inside the load window."""
    rng = random.Random(seed)
    kinds = list(FAULT_KINDS)
    rng.shuffle(kinds)
    start, end = WINDOW[0] * duration_s, WINDOW[1] * duration_s
    gap = max(1.0, (end - start - outage_s) / len(kinds))
    faults, at = [], start
    for kind in kinds:
        faults.append(Fault(kind, round(at + rng.uniform(0, 0.3 * gap), 1)))
        at += gap + (outage_s if kind == OUTAGE else 0.0)
    return faults


def _handed_over(victim: Proc) -> str:
    """What the drained worker's log says it handed over (its streams that were still running
    after the propagation delay), or that its drain never got to the move step."""
    found = [m for line in victim.lines if (m := re.search(r"drain of \w+: (\d+) requests handed over", line))]
    return f", handed over {sum(int(m.group(1)) for m in found)}" if found else ", no move step in its log"


class FaultRunner:
    """Carries out a plan against a mesh; times are seconds since `t0` (the start of the load)."""

    def __init__(self, mesh: ChaosMesh, seed: int, outage_s: float, busy: Callable[[], Counter[str]],
                 t0: float) -> None:
        self.mesh = mesh
        self.rng = random.Random(seed * 7919 + 1)
        self.outage_s = outage_s
        self.busy = busy
        self.t0 = t0
        self._pending: list[asyncio.Task[None]] = []

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    async def run(self, faults: list[Fault]) -> None:
        """Every fault in order, none before its planned time; returns once every replacement
        has served or failed to."""
        try:
            for fault in faults:
                await asyncio.sleep(max(0.0, fault.planned_s - (time.monotonic() - self.t0)))
                if fault.kind == OUTAGE:
                    await self._settle_pending()
                    await self._etcd_outage(fault)
                elif fault.kind == ROLL:
                    self._replace(fault, DECODE, signal.SIGTERM)
                else:
                    self._replace(fault, KILLS[fault.kind], signal.SIGKILL)
            await self._settle_pending()
        finally:
            for task in self._pending:
                task.cancel()

    async def _settle_pending(self) -> None:
        await asyncio.gather(*self._pending)
        self._pending.clear()

    def _pick(self, role: str, candidates: list[Proc]) -> Proc:
        candidates = sorted(candidates, key=lambda c: c.name)
        if role != DECODE:
            return self.rng.choice(candidates)
        load = self.busy()
        streams = {c.name: sum(load[i] for i in c.ids) for c in candidates}
        most = max(streams.values())
        return self.rng.choice([c for c in candidates if streams[c.name] == most])

    def _replace(self, fault: Fault, role: str, sig: signal.Signals) -> None:
        fault.started_s = self.now()
        candidates = self.mesh.live(role)
        if not candidates:
            fault.fail(f"no running {role} to signal")
            return
        victim = self._pick(role, candidates)
        in_flight = sum(self.busy()[i] for i in victim.ids)
        victim.signalled = sig.name
        victim.send(sig)
        replacement = self.mesh.spawn(role)
        fault.victim = f"{victim.name} pid {victim.pid}" + (f", {in_flight} streams" if role == DECODE else "")
        fault.replacement = replacement.name
        self._pending.append(asyncio.create_task(self._follow(fault, victim, replacement, sig)))

    async def _follow(self, fault: Fault, victim: Proc, replacement: Proc, sig: signal.Signals) -> None:
        """Waits for the victim to exit and the replacement to serve, and notes what went wrong."""
        code = await victim.wait_async(self.mesh.layout.drain_timeout_s + 20)
        if code is None:
            fault.fail(f"{victim.name} still running {self.mesh.layout.drain_timeout_s + 20:.0f}s after {sig.name}")
            victim.send(signal.SIGKILL)
            await victim.wait_async(10)
        elif sig == signal.SIGTERM:
            fault.note = f"drained, exit {code} at {self.now()}s{_handed_over(victim)}"
            if code != 0:
                fault.fail(f"drain exit status {code} (want 0)")
        try:
            await self.mesh.until_ready(replacement)
            fault.ended_s = self.now()
        except ProcFailed as exc:
            fault.fail(f"replacement did not serve: {str(exc).splitlines()[0]}")

    async def _etcd_outage(self, fault: Fault) -> None:
        fault.started_s = self.now()
        fault.victim = f"etcd pid {self.mesh.etcd.proc.pid if self.mesh.etcd.proc else '?'}"
        code = await self.mesh.etcd.halt_async()
        await asyncio.sleep(self.outage_s)
        try:
            await self.mesh.etcd.serve_async()
        except ProcFailed as exc:
            fault.fail(f"etcd did not come back: {exc}")
            return
        fault.replacement = self.mesh.etcd.proc.name if self.mesh.etcd.proc else ""
        fault.note = f"down {self.outage_s:g}s (etcd exit {code})"
        fault.ended_s = self.now()
