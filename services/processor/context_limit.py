"""The context length this processor enforces for its model, kept current from discovery.

The rule is the contract's (services/contract/served_context.py): the smallest `max_model_len`
the model's decode workers publish, since a request may be routed to any of them. While no decode
worker of the model publishes one (none has joined yet, or all left), the model's own config.json
(`max_position_embeddings`, read by the tokenizer) stands in; the first worker to join replaces it.

It is recomputed when a decode worker joins, leaves or changes its record (the view's listener),
never per request: a request reads `tokens`, a plain attribute. Each change is logged, and heard
by `changes()` (the processor republishes its record with it: it publishes what it enforces).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from services.contract.served_context import PublishedRecord, published_context, served_context
from services.mesh.discovery import ComponentView

log = logging.getLogger(__name__)


class ContextLimit:
    def __init__(self, model: str, fallback: int) -> None:
        """`model`: the served model name; `fallback`: its config.json context length."""
        self.model = model
        self.fallback = fallback
        # The longest a prompt plus its output may be, in tokens: what every request is checked against.
        self.tokens = fallback
        self._workers: dict[str, PublishedRecord] = {}
        self._changed = asyncio.Event()

    def follow(self, decode_workers: ComponentView) -> None:
        """Follows the decode pool from now on, starting with the workers already known."""
        decode_workers.add_listener(self.heard)
        if served_context(self._workers.values(), self.model) is None:
            self._log(None)  # a limit taken from the workers was logged as they were heard

    def heard(self, instance_id: str, record: PublishedRecord | None) -> None:
        """A decode worker joined or changed its record (`record`), or left (None)."""
        if record is None:
            self._workers.pop(instance_id, None)
        elif record.model == self.model:
            self._workers[instance_id] = record
        else:
            return
        served = served_context(self._workers.values(), self.model)
        tokens = self.fallback if served is None else served
        if tokens != self.tokens:
            self.tokens = tokens
            self._log(served)
            self._changed.set()

    async def changes(self) -> AsyncIterator[int]:
        """The limit after each change (changes close together may be heard as one: the latest)."""
        while True:
            await self._changed.wait()
            self._changed.clear()
            yield self.tokens

    def _log(self, served: int | None) -> None:
        if served is None:
            log.info("context length of %s: %d tokens, from its config.json (no decode worker publishes one)",
                     self.model, self.tokens)
            return
        lengths = sorted({n for w in self._workers.values() if (n := published_context(w)) is not None})
        if len(lengths) > 1:
            log.warning("the decode workers of %s serve different context lengths (%s tokens): %d, the smallest, "
                        "is enforced", self.model, ", ".join(map(str, lengths)), self.tokens)
        else:
            log.info("context length of %s: %d tokens, as its %d decode worker(s) serve it", self.model,
                     self.tokens, len(self._workers))
