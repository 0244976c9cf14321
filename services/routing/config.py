"""The router's settings, validated where they are built (the flags are in flags.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.config_error import ConfigError
from services.routing.cost_function import CostModel, CostWeights
from services.routing.kv_truth import KvTruthConfig
from services.routing.pickers import ROUTER_MODES


@dataclass(frozen=True)
class RouterConfig:
    mode: str = "kv"
    seed: int | None = None
    weights: CostWeights = field(default_factory=CostWeights)
    kv_truth: KvTruthConfig = field(default_factory=KvTruthConfig)
    # Hash a prompt's image blocks with its images (kv_protocol/media.py), as the workers do.
    # False (--no-media-aware-routing): the tokens alone, so no image block ever matches: what a
    # router that knows nothing of images scores; the multimodal benchmark's baseline.
    media_aware: bool = True

    def __post_init__(self) -> None:
        if self.mode not in ROUTER_MODES:
            raise ConfigError(f"--router-mode {self.mode!r} is not one of {', '.join(ROUTER_MODES)}")
        if self.weights.temperature < 0:
            raise ConfigError(f"--router-temperature must be >= 0, got {self.weights.temperature}")
        host = self.weights.host_overlap
        if host is not None and not 0 <= host <= 1:
            raise ConfigError(f"--host-overlap-weight must be within 0..1 (a host hit is worth at most a device "
                              f"hit), got {host}")

    @property
    def cost_model(self) -> CostModel:
        """The rule a `kv` router scores workers with (`--cost-model`); it travels in `weights`, which
        the picker is built from."""
        return self.weights.model
