"""When to prefill remotely: the conditional disaggregation rule.

    remote  iff  prompt_len * (1 - prefix_hit_rate) > max_local_prefill_length
            and  prefill_queue_size < max_prefill_queue_size

A short prompt, or one mostly cached here, is cheaper to prefill locally than to move; a busy
prefill pool would only make the request wait longer than prefilling it here.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.config_error import ConfigError


@dataclass(frozen=True)
class DisaggConfig:
    remote_prefill: bool = True  # off: always local
    conditional_disagg: bool = True  # off: always remote when prefill workers exist
    max_local_prefill_length: int = 512
    max_prefill_queue_size: int = 2
    prefill_timeout_s: float = 30.0
    # Whether this worker can receive a prompt's KV from a prefill worker (NIXL).
    can_receive_kv: bool = True

    def __post_init__(self) -> None:
        if self.remote_prefill and not self.can_receive_kv:
            raise ConfigError("--remote-prefill needs --kv-transfer nixl (the KV cache has to come over NIXL)")
        if self.max_local_prefill_length < 0 or self.max_prefill_queue_size < 0:
            raise ConfigError("--max-local-prefill-length and --max-prefill-queue-size must be >= 0")
        if not self.prefill_timeout_s > 0:
            raise ConfigError(f"--prefill-timeout must be > 0, got {self.prefill_timeout_s}")


def absolute_prefill_length(prompt_len: int, prefix_hit_rate: float) -> int:
    return int(prompt_len * (1.0 - min(max(prefix_hit_rate, 0.0), 1.0)))


def worth_remote(prompt_len: int, prefix_hit_rate: float, config: DisaggConfig) -> bool:
    """The length half of the rule, checked before asking anyone about the prefill queue."""
    if not config.remote_prefill:
        return False
    if not config.conditional_disagg:
        return True
    return absolute_prefill_length(prompt_len, prefix_hit_rate) > config.max_local_prefill_length


def prefill_remote(prompt_len: int, prefix_hit_rate: float, queue_size: int, config: DisaggConfig) -> bool:
    """The whole rule."""
    if not worth_remote(prompt_len, prefix_hit_rate, config):
        return False
    return not config.conditional_disagg or queue_size < config.max_prefill_queue_size
