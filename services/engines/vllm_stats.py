"""What vLLM's engine reports each step, as the worker reads it: its scheduler's load and prefix-cache
hits (the stat logger vLLM calls), and the NIXL transfers its KV connector made."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class LoadRecorder:
    """Keeps the latest scheduler stats that vLLM hands its stat loggers every engine step."""

    def __init__(self, on_transfer: Callable[[int, float], None]) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._on_transfer = on_transfer

    def factory(self):
        from vllm.v1.metrics.loggers import StatLoggerBase

        recorder = self

        class _Logger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
                if scheduler_stats is None:
                    return
                recorder.running = scheduler_stats.num_running_reqs
                recorder.waiting = scheduler_stats.num_waiting_reqs
                recorder.kv_usage = scheduler_stats.kv_cache_usage
                pcs = scheduler_stats.prefix_cache_stats
                recorder.prefix_queries += pcs.queries
                recorder.prefix_hits += pcs.hits
                for nbytes, seconds in nixl_transfers(scheduler_stats.kv_connector_stats):
                    recorder._on_transfer(nbytes, seconds)

            def log_engine_initialized(self) -> None:
                pass

        return _Logger


def nixl_transfers(stats: Any) -> list[tuple[int, float]]:
    """(bytes, seconds) per NIXL transfer from vLLM's connector stats, wherever they are nested."""
    if not isinstance(stats, dict):
        return []
    if "bytes_transferred" in stats and "transfer_duration" in stats:
        return list(zip(stats["bytes_transferred"], stats["transfer_duration"]))
    out: list[tuple[int, float]] = []
    for value in stats.values():
        data = getattr(value, "data", value)
        out.extend(nixl_transfers(data))
    return out
