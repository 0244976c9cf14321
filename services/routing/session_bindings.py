"""Agent sessions bound to workers: a session's requests go where its KV is.

An agent's next turn shares its whole history with the last one, but a tool runs for seconds to
minutes in between: by then other traffic may have evicted the history, or moved it to the host
tier, and load alone may send the turn elsewhere. So a request of a session (`SessionKey`, from
the gateway's `x-session-id`) is bound to the worker the router chose for it, for `ttl_s` after
its last request, and the session's next request:
- `soft` (the default): gets `weight` added to that worker's score (the cached-share rule's logit;
  in the Dynamo rule, that many whole prompts of prefill off its cost): a strong preference the
  load terms can still outweigh when the worker is overloaded;
- `hard`: goes to that worker alone, while it is a candidate (alive, serving the model and the
  adapter, not excluded by a retry);
- either way, a session whose worker is gone, excluded or outweighed is bound anew where it went
  (`MOVED`): a migrated request takes its binding along.
A sub-agent (`parent_id`) with no binding of its own is placed with its parent's worker preferred
(soft, whatever the mode): it shares the parent's prefix, load allowing.

The binding also tells the worker to keep the session's blocks for the TTL once the request ends
(`retain_ms`: pinned on the device within its budget, else in its host tier; see the mocker's
session pins). `off` binds nothing and asks nothing kept: plain kv routing.

Bindings live here, in memory, bounded (`MAX_BINDINGS`, the least recently used go first), and in
etcd, so every router replica and every processor routing locally sees them (session_store.py
mirrors them both ways). A binding's expiry is wall-clock time, so replicas agree on it.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum

from gen.kvmesh.v1 import common_pb2
from services.config_error import ConfigError

# Sessions one router remembers at most; past it the least recently used binding is forgotten.
MAX_BINDINGS = 100_000
# The longest TTL a binding may have (a day): retention holds blocks for that long.
MAX_TTL_S = 86_400.0


class Affinity(StrEnum):
    """How a session's binding weighs (`--session-affinity`)."""

    OFF = "off"
    SOFT = "soft"
    HARD = "hard"


AFFINITIES = tuple(a.value for a in Affinity)


@dataclass(frozen=True)
class SessionConfig:
    affinity: Affinity = Affinity.SOFT
    # How long after its last request a session stays bound (and its blocks kept).
    ttl_s: float = 300.0
    # The soft preference, in the cost rule's units (cached-share: logit; dynamo: whole prompts of prefill).
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.affinity, Affinity):
            raise ConfigError(f"--session-affinity {self.affinity!r} is not one of {', '.join(AFFINITIES)}")
        if not (math.isfinite(self.ttl_s) and 0 < self.ttl_s <= MAX_TTL_S):
            raise ConfigError(f"--session-ttl must be > 0 and <= {MAX_TTL_S:.0f} seconds, got {self.ttl_s}")
        if not (math.isfinite(self.weight) and self.weight >= 0):
            raise ConfigError(f"--session-weight must be finite and >= 0, got {self.weight}")

    @property
    def retain_ms(self) -> int:
        return 0 if self.affinity is Affinity.OFF else round(self.ttl_s * 1000)


@dataclass(frozen=True, slots=True)
class SessionKey:
    """The session a query belongs to (the wire's SessionRef less what the router sets)."""

    id: str
    parent_id: str = ""


@dataclass(frozen=True, slots=True)
class Binding:
    worker_id: str
    # Unix seconds: past it the binding is gone.
    expires_at: float


@dataclass(frozen=True, slots=True)
class Preference:
    """What a session asks of one decision: a worker to prefer (or keep to), and why."""

    worker_id: str | None
    # Keep to the worker (hard affinity, the session's own binding).
    only: bool
    # The route if that worker is chosen; a choice elsewhere is MOVED (or NEW with no worker).
    route: common_pb2.SessionRoute


NO_PREFERENCE = Preference(None, False, common_pb2.SESSION_ROUTE_NEW)

# Hears every binding this router made or refreshed: (session id, binding). session_store.py
# writes them to etcd.
BindingListener = Callable[[str, Binding], None]


class SessionBindings:
    """The bindings this router knows (its own and, through etcd, the other replicas')."""

    def __init__(self, config: SessionConfig, clock: Callable[[], float] = time.time,
                 max_bindings: int = MAX_BINDINGS) -> None:
        self.config = config
        self._clock = clock
        self._max = max_bindings
        self._bindings: OrderedDict[str, Binding] = OrderedDict()
        self._listeners: list[BindingListener] = []

    @property
    def active(self) -> bool:
        return self.config.affinity is not Affinity.OFF

    def __len__(self) -> int:
        return len(self._bindings)

    def add_listener(self, listener: BindingListener) -> None:
        self._listeners.append(listener)

    def bound(self, session_id: str) -> str | None:
        """The worker the session is bound to now, if any."""
        binding = self._bindings.get(session_id)
        if binding is None:
            return None
        if binding.expires_at <= self._clock():
            del self._bindings[session_id]
            return None
        return binding.worker_id

    def preference(self, session: SessionKey | None, candidates: Iterable[str]) -> Preference:
        """What the session asks of a decision among `candidates` (worker ids)."""
        if session is None or not self.active:
            return NO_PREFERENCE
        ids = set(candidates)
        own = self.bound(session.id)
        if own is not None:
            if own in ids:
                return Preference(own, self.config.affinity is Affinity.HARD, common_pb2.SESSION_ROUTE_BOUND)
            return Preference(None, False, common_pb2.SESSION_ROUTE_MOVED)
        parent = self.bound(session.parent_id) if session.parent_id else None
        if parent is not None and parent in ids:
            return Preference(parent, False, common_pb2.SESSION_ROUTE_PARENT)
        return NO_PREFERENCE

    def bind(self, session: SessionKey, worker_id: str, preference: Preference) -> common_pb2.SessionRoute:
        """Binds the session to the chosen worker for the TTL from now; returns the route it took."""
        expires = self._clock() + self.config.ttl_s
        held = self._bindings.get(session.id)
        if held is not None and held.worker_id == worker_id:
            expires = max(expires, held.expires_at)  # a replica's longer TTL is kept
        # This router's own decision wins over whatever it learned: it is where the request went.
        binding = self._bindings[session.id] = Binding(worker_id, expires)
        self._bindings.move_to_end(session.id)
        self._bound()
        for listener in self._listeners:
            listener(session.id, binding)
        if preference.worker_id is None or worker_id == preference.worker_id:
            return preference.route
        if preference.route == common_pb2.SESSION_ROUTE_PARENT:
            return common_pb2.SESSION_ROUTE_NEW  # a sub-agent placed away from its parent: never bound before
        return common_pb2.SESSION_ROUTE_MOVED

    def learn(self, session_id: str, binding: Binding) -> None:
        """Takes a binding (made here, or by another replica: etcd), unless it is already past or
        older than the one held."""
        if binding.expires_at <= self._clock():
            return
        held = self._bindings.get(session_id)
        if held is not None and held.expires_at > binding.expires_at:
            return
        self._bindings[session_id] = binding
        self._bindings.move_to_end(session_id)
        self._bound()

    def _bound(self) -> None:
        while len(self._bindings) > self._max:
            self._bindings.popitem(last=False)

    def live(self) -> int:
        """Bindings not run out (the gauge's value; counted when scraped)."""
        now = self._clock()
        return sum(1 for b in self._bindings.values() if b.expires_at > now)

    def forget(self, session_id: str, within_s: float | None = None) -> None:
        """Drops a binding (its etcd key expired or was deleted); `within_s`: only if it runs out
        within that many seconds from now (by this router's clock): not one renewed since."""
        held = self._bindings.get(session_id)
        if held is not None and (within_s is None or held.expires_at <= self._clock() + within_s):
            del self._bindings[session_id]
