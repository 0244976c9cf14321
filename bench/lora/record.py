"""One workload of the LoRA benchmark (`Case`) and one run of it (`Run`): a mode and seed, what its client saw
and the workers counted. Their own module, below run.py (which makes runs) and report.py / plot.py (which read
them)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from bench.common.report import percentile
from bench.lora import adapter_metrics
from bench.lora.adapter_metrics import PerAdapter
from bench.lora.drive import Phase
from bench.lora.workload import LoraWorkload


@dataclass(frozen=True)
class Case:
    """One workload of the benchmark: its key in the JSON, its name in the tables, the seeds it runs."""

    key: str
    title: str
    workload: LoraWorkload
    seeds: tuple[int, ...] = (0, 1, 2)

    def overlap_term(self) -> float:
        """What the prefix holder's cached share weighs (the cost function's 2 x overlap ratio)."""
        w = self.workload
        return 2 * w.prefix_tokens / (w.prefix_tokens + w.user_tokens)

    def popularity_groups(self) -> dict[str, range]:
        return {"top 4": range(0, 4), "5-16": range(4, 16), "17-32": range(16, self.workload.adapters)}


@dataclass
class Run:
    case: Case
    mode: str
    seed: int
    warmup: Phase
    measured: Phase
    loads: PerAdapter  # of the measured phase, per (worker, adapter)
    resident: dict[str, list[str]]  # per worker, at the end
    floor_loads: int
    seconds: float
    workers: int  # decode workers of the mesh
    names: list[str] = field(default_factory=list)  # the adapters, hottest first

    def figures(self) -> dict[str, float]:
        done = self.measured.done
        ttft = [o.ttft_ms for o in done]
        prompt = sum(o.prompt_tokens for o in done)
        return {"loads_per_1k": 1000 * sum(self.loads.values()) / len(done) if done else float("nan"),
                "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
                "reuse": sum(o.cached_tokens for o in done) / prompt if prompt else float("nan")}

    def floor_per_1k(self) -> float:
        return 1000 * self.floor_loads / self.case.workload.requests

    def loads_by_group(self) -> dict[str, float]:
        """Loads per 1,000 requests for the adapters of each popularity group."""
        by_adapter = adapter_metrics.loads_by_adapter(self.loads)
        done = len(self.measured.done) or 1
        return {group: 1000 * sum(by_adapter.get(self.names[i], 0) for i in members) / done
                for group, members in self.case.popularity_groups().items()}

    def workers_per_hot_adapter(self) -> float:
        """How many workers served each of the 4 hottest adapters, on average."""
        hot = set(self.names[:4])
        workers: dict[str, set[str]] = {}
        for o in self.measured.done:
            if o.adapter in hot:
                workers.setdefault(o.adapter, set()).add(o.worker)
        return sum(len(w) for w in workers.values()) / len(hot)

    def adapters_per_worker(self) -> float:
        """How many distinct adapters each worker served, on average."""
        adapters: dict[str, set[str]] = {}
        for o in self.measured.done:
            adapters.setdefault(o.worker, set()).add(o.adapter)
        return sum(len(a) for a in adapters.values()) / self.workers

    def ttft_p99_by_worker(self) -> dict[str, float]:
        ttft: dict[str, list[float]] = {}
        for o in self.measured.done:
            ttft.setdefault(o.worker, []).append(o.ttft_ms)
        return {worker: round(percentile(values, 99), 1) for worker, values in sorted(ttft.items())}

    def to_json(self) -> dict:
        return {"mode": self.mode, "seed": self.seed, "seconds": round(self.seconds, 1),
                "done": len(self.measured.done), "failures": self.measured.failures,
                "warmup_failures": self.warmup.failures, **self.figures(), "floor_loads_per_1k": self.floor_per_1k(),
                "loads_by_group_per_1k": self.loads_by_group(),
                "workers_per_hot_adapter": self.workers_per_hot_adapter(),
                "adapters_per_worker": self.adapters_per_worker(),
                "requests_per_worker": dict(Counter(o.worker for o in self.measured.done)),
                "ttft_p99_ms_by_worker": self.ttft_p99_by_worker(),
                "loads_by_worker": adapter_metrics.loads_by_worker(self.loads),
                "loads_by_adapter": adapter_metrics.loads_by_adapter(self.loads),
                "resident_at_end": self.resident}
