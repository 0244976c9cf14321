"""Counters of the processors and decode workers, scraped all through the chaos run.

Processes die and restart during the run and a counter dies with its process, so a single read
at the end would miss everything the killed instances counted. `MetricsWatcher` scrapes every
instance etcd lists (falling back to the last list it got while etcd is down) every couple of
seconds and keeps each instance's last reading; the totals are the sum of those last readings —
a lower bound: what a killed instance counted after its last scrape is lost.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass, field

import aiohttp
from bench.chaos.mesh import DECODE, PROCESSOR, ChaosMesh
from services.mesh.discovery import InstanceInfo
from services.mesh.etcd_store import StoreUnavailable
from testkit import metrics

MIGRATIONS = "kvmesh_processor_migrations_total"
WORKER_FAILURES = "kvmesh_processor_worker_failures_total"
FALLBACKS = "kvmesh_decode_prefill_fallback_total"
REMOTE = "kvmesh_decode_remote_prefill_total"
LOCAL = "kvmesh_decode_local_prefill_total"
HANDOFFS = "kvmesh_processor_handoffs_total"
RECOMPUTED = "kvmesh_processor_resumed_tokens_recomputed_total"
WANTED = (MIGRATIONS, WORKER_FAILURES, FALLBACKS, REMOTE, LOCAL, HANDOFFS, RECOMPUTED)
SCRAPE_EVERY_S = 2.0


@dataclass
class Reading:
    component: str
    values: dict[str, float] = field(default_factory=dict)
    fallback_reasons: dict[str, float] = field(default_factory=dict)


def parse(text: str, component: str) -> Reading:
    """The wanted counters of one /metrics page, summed over their labels."""
    reading = Reading(component)
    samples = metrics.parse(text)
    for name in WANTED:
        if found := metrics.matching(samples, name):
            reading.values[name] = sum(s.value for s in found)
    for sample in metrics.matching(samples, FALLBACKS):
        reason = sample.labels.get("reason", "?")
        reading.fallback_reasons[reason] = reading.fallback_reasons.get(reason, 0.0) + sample.value
    return reading


class MetricsWatcher:
    def __init__(self, mesh: ChaosMesh) -> None:
        self.mesh = mesh
        # Only what etcd lists (or listed last, while it is down): a dead instance's port may be reused.
        self.listed: list[InstanceInfo] = []
        self.last: dict[str, Reading] = {}
        self.scrapes = 0

    async def run(self, stop: asyncio.Event) -> None:
        """Scrapes until `stop` is set, then once more."""
        timeout = aiohttp.ClientTimeout(total=3)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not stop.is_set():
                await self.scrape(session)
                try:
                    await asyncio.wait_for(stop.wait(), SCRAPE_EVERY_S)
                except TimeoutError:
                    pass
            await self.scrape(session)

    async def scrape(self, session: aiohttp.ClientSession) -> None:
        try:
            listed = await self.mesh.registered([PROCESSOR, DECODE])
            self.listed = [i for infos in listed.values() for i in infos if i.metrics_port]
        except (StoreUnavailable, OSError, TimeoutError):
            pass  # etcd is down: scrape the instances listed last
        await asyncio.gather(*(self._one(session, i) for i in self.listed))
        self.scrapes += 1

    async def _one(self, session: aiohttp.ClientSession, info: InstanceInfo) -> None:
        host = info.address.rsplit(":", 1)[0] or "127.0.0.1"
        try:
            async with session.get(f"http://{host}:{info.metrics_port}/metrics") as r:
                if r.status == 200:
                    self.last[info.instance_id] = parse(await r.text(), info.component)
        except (aiohttp.ClientError, TimeoutError):
            pass  # gone (killed or drained): its last reading stays

    def total(self, name: str) -> float:
        return sum(r.values.get(name, 0.0) for r in self.last.values())

    def fallback_reasons(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for r in self.last.values():
            for reason, value in r.fallback_reasons.items():
                out[reason] += value
        return dict(out)

    def instances(self, component: str) -> int:
        return sum(1 for r in self.last.values() if r.component == component)
