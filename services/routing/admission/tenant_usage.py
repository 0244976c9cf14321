"""What each tenant uses now: requests in flight (waiting or running) and tokens admitted in the
last minute, checked against its policy before a request may queue."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from gen.kvmesh.v1 import common_pb2
from services.routing.admission.tenant_policy import TenantPolicy

WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class LimitHit:
    """A tenant limit that refuses a request: which, and when a retry may fit."""

    overload: common_pb2.Overload
    retry_after_s: float
    message: str


@dataclass(slots=True)
class _Usage:
    in_flight: int = 0
    # (admitted at, tokens) in the last minute, oldest first, and their sum.
    charges: deque[tuple[float, int]] = field(default_factory=deque)
    tokens: int = 0


class TenantUsage:
    def __init__(self) -> None:
        self._by_tenant: dict[str, _Usage] = {}

    def in_flight(self, tenant: str) -> int:
        u = self._by_tenant.get(tenant)
        return u.in_flight if u is not None else 0

    def check(self, tenant: str, policy: TenantPolicy, tokens: int, now: float, share: float = 1.0,
              mean_hold_s: float = 1.0) -> LimitHit | None:
        """The limit a new request of `tokens` would break, if any. `share`: this router's part
        of the mesh-wide limits (1 / the routers serving the pool)."""
        u = self._expire(tenant, now)
        if policy.max_concurrency:
            allowed = max(1, math.floor(policy.max_concurrency * share))
            if u is not None and u.in_flight >= allowed:
                return LimitHit(common_pb2.OVERLOAD_TENANT_CONCURRENCY, mean_hold_s,
                                f"tenant {tenant!r} has {u.in_flight} requests in flight, its limit here")
        if policy.tokens_per_minute:
            allowed = max(1, math.floor(policy.tokens_per_minute * share))
            used = u.tokens if u is not None else 0
            if used + tokens > allowed:
                if tokens > allowed:
                    retry = WINDOW_S  # fits only an empty window
                else:
                    retry = self._until_room(u, used + tokens - allowed, now) if u is not None else 0.0
                return LimitHit(common_pb2.OVERLOAD_TENANT_TOKENS, retry,
                                f"tenant {tenant!r} spent its tokens per minute ({used} of {allowed} here)")
        return None

    def admitted(self, tenant: str, tokens: int, now: float) -> None:
        u = self._by_tenant.get(tenant)
        if u is None:
            u = self._by_tenant[tenant] = _Usage()
        u.in_flight += 1
        if tokens:
            u.charges.append((now, tokens))
            u.tokens += tokens

    def ended(self, tenant: str, now: float) -> None:
        u = self._by_tenant.get(tenant)
        if u is None:
            return
        u.in_flight -= 1
        self._expire(tenant, now)

    def _expire(self, tenant: str, now: float) -> _Usage | None:
        u = self._by_tenant.get(tenant)
        if u is None:
            return None
        horizon = now - WINDOW_S
        while u.charges and u.charges[0][0] <= horizon:
            u.tokens -= u.charges.popleft()[1]
        if not u.in_flight and not u.charges:
            del self._by_tenant[tenant]  # nothing to remember: the map holds active tenants only
            return None
        return u

    @staticmethod
    def _until_room(u: _Usage, excess: int, now: float) -> float:
        """Seconds until charges of at least `excess` tokens have left the window."""
        freed = 0
        for at, tokens in u.charges:
            freed += tokens
            if freed >= excess:
                return max(0.0, at + WINDOW_S - now)
        return WINDOW_S
