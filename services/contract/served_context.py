"""The context length a model is served with: the smallest its decode workers publish.

A request may be routed to any decode worker of its model (aggregated workers register as decode
workers), so a prompt is taken only if every one of them can hold it: the served context length
of a model is the smallest `max_model_len` among the decode workers of that model in discovery
(each worker publishes its engine's in its record's `extra`: vLLM's `max_model_len`, the mocker's
`--max-model-len`, else the model's `max_position_embeddings`). Prefill workers do not count: a
prompt a prefill worker cannot take is prefilled on its decode worker instead (remote_prefill.py).

None while no decode worker of the model publishes one; the processor then enforces the model's
own config.json (its fallback, services/processor/context_limit.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

# The key of a worker's record `extra` that holds its engine's context length, in tokens.
MAX_MODEL_LEN = "max_model_len"


class PublishedRecord(Protocol):
    """What the rule reads of a worker's discovery record (services/mesh/discovery.py's InstanceInfo)."""

    @property
    def model(self) -> str: ...

    @property
    def extra(self) -> Mapping[str, Any]: ...


def published_context(record: PublishedRecord) -> int | None:
    """The context length a worker's record publishes; None if it publishes none (or no positive int)."""
    value = record.extra.get(MAX_MODEL_LEN)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def served_context(decode_workers: Iterable[PublishedRecord], model: str) -> int | None:
    """The smallest context length the decode workers of `model` publish; None if none does."""
    lengths = [n for w in decode_workers if w.model == model and (n := published_context(w)) is not None]
    return min(lengths, default=None)
