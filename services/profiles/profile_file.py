"""A worker profile on disk: the cost model, the measurements it was fitted to, and what they
were measured on (engine, model, block size, machine).

    {"format": "kvmesh-worker-profile/1", "engine": "vllm", "model": "demo", "block_size": 32,
     "machine": "...", "measured_at": "2026-11-25T14:00:00Z", "source": "...",
     "cost_model": {"prefill_base_s": ..., ...},
     "prefill_points": [[prompt_tokens, seconds], ...],
     "decode_points": [[batch, context_tokens_per_seq, step_seconds], ...],
     "fit_error": {"prefill": 0.03, "decode": 0.05}}

`fit_error` is the median relative error of the cost model on the points. A name instead of a
path (`h100-8b`) means the preset of that name shipped in `presets/`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from services.profiles.cost_model import CostModel, ProfileError

FORMAT = "kvmesh-worker-profile/1"
_INNER_LIST = re.compile(r"\[\s*([-0-9.e+]+(?:,\s*[-0-9.e+]+)*)\s*\]")
PRESET_DIR = Path(__file__).parent / "presets"
DEFAULT_PRESET = "h100-8b"


@dataclass(frozen=True)
class WorkerProfile:
    cost: CostModel
    engine: str = ""
    model: str = ""
    block_size: int = 0
    machine: str = ""
    measured_at: str = ""
    source: str = ""
    prefill_points: tuple[tuple[int, float], ...] = ()
    decode_points: tuple[tuple[int, int, float], ...] = ()
    fit_error: dict[str, float] = field(default_factory=dict)

    def scaled(self, factor: float, why: str) -> WorkerProfile:
        """The same profile with every duration times `factor` (a machine that much slower)."""
        return replace(self, cost=self.cost.scaled(factor), source=f"{self.source}; {why}".lstrip("; "),
                       prefill_points=tuple((n, s * factor) for n, s in self.prefill_points),
                       decode_points=tuple((b, c, s * factor) for b, c, s in self.decode_points))

    def to_json(self) -> str:
        data = {"format": FORMAT, "engine": self.engine, "model": self.model, "block_size": self.block_size,
                "machine": self.machine, "measured_at": self.measured_at, "source": self.source,
                "cost_model": self.cost.to_dict(), "prefill_points": [list(p) for p in self.prefill_points],
                "decode_points": [list(p) for p in self.decode_points], "fit_error": self.fit_error}
        # One point per line: a profile is read by people as well.
        return _INNER_LIST.sub(lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]",
                               json.dumps(data, indent=1)) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str) -> WorkerProfile:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"{where}: not JSON ({exc})") from exc
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ProfileError(f"{where}: not a worker profile (expected \"format\": \"{FORMAT}\")")
        try:
            return cls(
                cost=CostModel.from_dict(data.get("cost_model")),
                engine=str(data.get("engine", "")), model=str(data.get("model", "")),
                block_size=int(data.get("block_size", 0)), machine=str(data.get("machine", "")),
                measured_at=str(data.get("measured_at", "")), source=str(data.get("source", "")),
                prefill_points=tuple((int(n), _seconds(s)) for n, s in data.get("prefill_points", ())),
                decode_points=tuple((int(b), int(c), _seconds(s)) for b, c, s in data.get("decode_points", ())),
                fit_error={str(k): float(v) for k, v in dict(data.get("fit_error", {})).items()},
            )
        except ProfileError as exc:
            raise ProfileError(f"{where}: {exc}") from exc
        except (TypeError, ValueError) as exc:
            raise ProfileError(f"{where}: malformed field ({exc})") from exc


def _seconds(value: object) -> float:
    s = float(value)  # type: ignore[arg-type]
    if not (math.isfinite(s) and s >= 0):
        raise ProfileError(f"a measured duration must be a finite number >= 0, got {value!r}")
    return s


def preset_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in PRESET_DIR.glob("*.json")))


def load_profile(name_or_path: str) -> WorkerProfile:
    """A preset by name, or a profile file by path."""
    path = Path(name_or_path)
    if name_or_path in preset_names():
        path = PRESET_DIR / f"{name_or_path}.json"
    elif not path.suffix and not path.exists():
        raise ProfileError(f"no profile {name_or_path!r}: not a file, and the presets are {', '.join(preset_names())}")
    try:
        text = path.read_text()
    except OSError as exc:
        raise ProfileError(f"cannot read the profile {name_or_path!r}: {exc.strerror or exc}") from exc
    return WorkerProfile.from_json(text, str(name_or_path))


def save_profile(profile: WorkerProfile, path: Path) -> None:
    """Written whole or not at all: a crash mid-write leaves the previous file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(profile.to_json())
    partial.replace(path)
