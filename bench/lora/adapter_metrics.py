"""The workers' LoRA figures, read from their /metrics: loads per (worker, adapter) and who holds which adapter.

Counters are read twice, between the warm-up and the measured phase and after the run, and the measured
phase's share is the difference (`minus`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench.common.mesh_metrics import metrics_urls
from services.mesh.discovery import DECODE_WORKER
from testkit import metrics
from testkit.mesh import LaunchedMesh

LOADS = "kvmesh_worker_lora_loads"  # counter {worker_id, lora_name}
RESIDENT = "kvmesh_worker_lora_resident"  # gauge {worker_id, lora_name}: 1 while loaded

# (worker id, adapter name) -> value
PerAdapter = dict[tuple[str, str], float]


@dataclass(frozen=True)
class AdapterSnapshot:
    loads: PerAdapter
    resident: PerAdapter

    def minus(self, before: AdapterSnapshot) -> PerAdapter:
        """The loads since `before`."""
        return {key: n - before.loads.get(key, 0.0) for key, n in self.loads.items()
                if n - before.loads.get(key, 0.0) > 0}

    def resident_by_worker(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for (worker, adapter), value in sorted(self.resident.items()):
            if value > 0:
                out.setdefault(worker, []).append(adapter)
        return out


def worker_urls(mesh: LaunchedMesh) -> list[str]:
    return metrics_urls(mesh, (DECODE_WORKER,)).get(DECODE_WORKER, [])


def snapshot(urls: Sequence[str]) -> AdapterSnapshot:
    loads: PerAdapter = {}
    resident: PerAdapter = {}
    for url in urls:
        samples = metrics.scrape(url, timeout_s=5)
        for target, name in ((loads, LOADS + "_total"), (resident, RESIDENT)):
            for sample in metrics.matching(samples, name):
                key = (sample.labels.get("worker_id", url), sample.labels.get("lora_name", ""))
                target[key] = target.get(key, 0.0) + sample.value
    return AdapterSnapshot(loads, resident)


def loads_by_adapter(loads: PerAdapter) -> dict[str, int]:
    out: dict[str, int] = {}
    for (_, adapter), n in loads.items():
        out[adapter] = out.get(adapter, 0) + int(n)
    return dict(sorted(out.items()))


def loads_by_worker(loads: PerAdapter) -> dict[str, int]:
    out: dict[str, int] = {}
    for (worker, _), n in loads.items():
        out[worker] = out.get(worker, 0) + int(n)
    return dict(sorted(out.items()))
