"""One run of the agents benchmark (`Run`): a mode and seed, what its client saw and the mesh counted.
Its own module, below run.py (which makes runs) and report.py / plot.py (which read them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.agents.drive import Driven
from bench.agents.run_figures import figures


@dataclass
class Run:
    mode: str
    seed: int
    driven: Driven
    counters: dict[str, float]
    cpu_s: dict[str, float]  # CPU seconds of each component's processes over the run (this machine's load)
    seconds: float
    block_size: int  # the mesh's KV block, in tokens
    _figures: dict[str, float] = field(default_factory=dict, repr=False)

    def figures(self) -> dict[str, float]:
        if not self._figures:
            self._figures.update(figures(self.driven, self.counters, self.block_size))
        return self._figures

    def to_json(self) -> dict:
        return {"mode": self.mode, "seed": self.seed, "seconds": round(self.seconds, 1), **self.figures(),
                "turns_not_sent": self.driven.turns_not_sent, "background_not_sent": self.driven.background_not_sent,
                "cut": self.driven.cut, "mesh_counters": self.counters,
                "cpu_s": {k: round(v, 1) for k, v in self.cpu_s.items()}}
