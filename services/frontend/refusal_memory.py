"""The gateway's short memory of the mesh's overload refusals.

Under a storm most requests are refused, and each refusal costs the gateway's parsing, the
processor's tokenizing and the router's forecast: on a busy machine that work alone makes
refusals slow and the admitted requests' streams late. The router's queue only opens again as
requests end (every few tens of milliseconds on a full pool), so for a moment after a refusal a
request of the same kind (model, tenant, priority, objective) would be refused again: the gateway
answers it at once with the same refusal, its Retry-After counted down, and the next one after
that moment goes to the mesh again. Another tenant's or band's requests are never answered so.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from services.frontend.errors import ApiError

# How long a refusal is remembered at most: about one request's end on a full pool.
MEMORY_S = 0.02
# Kinds remembered at once at most (tenants x bands x objectives): past it, the oldest go.
MAX_KINDS = 4096

RequestKind = tuple[str, str, int, int]


@dataclass(frozen=True, slots=True)
class _Refusal:
    until: float
    at: float
    error: ApiError


class RefusalMemory:
    def __init__(self, memory_s: float = MEMORY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._memory_s = memory_s
        self._clock = clock
        self._kinds: dict[RequestKind, _Refusal] = {}
        # Requests answered from memory (the frontend's counter reads it).
        self.answered = 0

    def recall(self, kind: RequestKind) -> ApiError | None:
        """The refusal a request of `kind` gets at once, if one is remembered."""
        refusal = self._kinds.get(kind)
        if refusal is None:
            return None
        now = self._clock()
        if now >= refusal.until:
            del self._kinds[kind]
            return None
        self.answered += 1
        e = refusal.error
        left_ms = max(1, e.retry_after_ms - round((now - refusal.at) * 1000))
        return ApiError(e.status, e.message, e.param, e.code, left_ms)

    def remember(self, kind: RequestKind, error: ApiError) -> None:
        """Keeps a refusal the mesh gave (a 429 saying when to retry), for a moment."""
        if error.status != 429 or not error.retry_after_ms:
            return
        if len(self._kinds) >= MAX_KINDS:
            now = self._clock()
            self._kinds = {k: r for k, r in self._kinds.items() if r.until > now}
            while len(self._kinds) >= MAX_KINDS:
                del self._kinds[next(iter(self._kinds))]
        now = self._clock()
        self._kinds[kind] = _Refusal(now + min(self._memory_s, error.retry_after_ms / 1000), now, error)
