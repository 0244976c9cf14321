"""Where the router learns each worker's cache, as configured (`--kv-events` and the prediction's
flags in flags.py; nested in RouterConfig, and apart from config.py so the worker pool can hold it
without importing the pickers)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from services.config_error import ConfigError
from services.routing.kv_source import DEFAULT_ACCURACY_FLOOR
from services.routing.predicted_cache import DEFAULT_MAX_BLOCKS, DEFAULT_TTL_S


class KvEventsMode(StrEnum):
    """`--kv-events`: whether the router follows workers' KV events at all."""

    # Follow them, predicting only a worker whose events are gone or wrong (kv_source.py).
    ON = "on"
    # Follow none: predict every worker's cache from the prompts routed to it.
    OFF = "off"


@dataclass(frozen=True)
class KvTruthConfig:
    """Where the router learns each worker's cache: its KV events, or (`kv_events` OFF, or per
    worker while its events cannot be trusted, see kv_source.py) a prediction from the prompts
    the router sent it (predicted_cache.py)."""

    kv_events: KvEventsMode = KvEventsMode.ON
    # How long a routed prompt's blocks are predicted to stay cached, and how many a worker's
    # prediction holds at most (least recently routed go first).
    prediction_ttl_s: float = DEFAULT_TTL_S
    prediction_max_blocks: int = DEFAULT_MAX_BLOCKS
    # A worker whose index accuracy (index_accuracy.py) falls under this is predicted instead.
    index_accuracy_floor: float = DEFAULT_ACCURACY_FLOOR

    def __post_init__(self) -> None:
        # The flag's string is converted where it is parsed (flags.py); a bare string here is a
        # caller that skipped that, even one naming a mode.
        if not isinstance(self.kv_events, KvEventsMode):
            raise ConfigError(f"--kv-events {self.kv_events!r} is not one of {', '.join(KvEventsMode)}")
        if self.prediction_ttl_s <= 0:
            raise ConfigError(f"--prediction-ttl must be > 0 seconds, got {self.prediction_ttl_s}")
        if self.prediction_max_blocks < 1:
            raise ConfigError(f"--prediction-max-blocks must be >= 1, got {self.prediction_max_blocks}")
        if not 0 <= self.index_accuracy_floor <= 1:
            raise ConfigError(f"--index-accuracy-floor must be within 0..1, got {self.index_accuracy_floor}")
