"""Session bindings shared in etcd, so a session's next request finds its worker whichever router
replica (or locally routing processor) it reaches.

Each binding is a key `/<ns>/sessions/<session id>` holding `{"worker": id, "expires": unix s}`.
Keys carry a lease that outlives the binding a little (ttl + `refresh_s`), so etcd drops a
binding nobody renewed by itself, even with every router gone. Leases are shared: a router grants
one per `refresh_s` and puts every binding of that stretch under it, instead of one per session.

Writes stay off the routing path: a decision only notes the binding (`SessionBindings.bind`); the
writer task puts what changed, coalesced per session, and a binding renewed to the same worker
is written again only once its etcd copy is `refresh_s` older than its expiry (so other replicas
may see an expiry up to `refresh_s` early: they then bind the session anew, usually to the same
worker, its prefix being cached there). etcd away: routing goes on from memory; the writes wait
(bounded: the latest per session) and go when it is back. The watch follows the other replicas'
bindings into `SessionBindings.learn` (mesh/prefix_follow.py: a broken watch is set up again from
a fresh listing). An expiry is wall-clock time, as every process reads it; this store reads it by
the bindings' own clock (`SessionBindings(clock=...)`), never one of its own.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging

from services.mesh.etcd_store import KeyValue, KeyValueStore, StoreUnavailable, WatchEvent
from services.mesh.prefix_follow import follow_prefix
from services.mesh.service_runner import ServiceRunner
from services.routing.session_bindings import MAX_BINDINGS, Binding, SessionBindings, SessionConfig

log = logging.getLogger(__name__)

# Most bindings written per etcd round; the rest wait for the next one.
WRITE_BATCH = 256
# The longest wait before writing again after etcd refused a write.
BACKOFF_MAX_S = 5.0


def sessions_prefix(namespace: str) -> str:
    return f"/{namespace}/sessions/"


def encode(binding: Binding) -> bytes:
    return json.dumps({"worker": binding.worker_id, "expires": round(binding.expires_at, 3)}).encode()


def decode(raw: bytes) -> Binding | None:
    try:
        data = json.loads(raw)
        return Binding(str(data["worker"]), float(data["expires"]))
    except (ValueError, KeyError, TypeError):
        return None


class SessionStore:
    """Mirrors one router's `SessionBindings` to and from etcd; `run` is its one task."""

    def __init__(self, store: KeyValueStore, namespace: str, bindings: SessionBindings) -> None:
        self._store = store
        self._prefix = sessions_prefix(namespace)
        self._bindings = bindings
        self._ttl_s = bindings.config.ttl_s
        self.refresh_s = max(1.0, self._ttl_s / 10)
        # Per session, the binding to write (the latest only), and what etcd holds of ours.
        self._dirty: dict[str, Binding] = {}
        self._written: dict[str, Binding] = {}
        self._wake = asyncio.Event()
        self._lease: tuple[int, float] | None = None  # (lease id, granted at, loop time)
        bindings.add_listener(self._note)

    def _note(self, session_id: str, binding: Binding) -> None:
        written = self._written.get(session_id)
        if (written is not None and written.worker_id == binding.worker_id
                and binding.expires_at - written.expires_at < self.refresh_s):
            return
        if session_id not in self._dirty and len(self._dirty) >= MAX_BINDINGS:
            return  # etcd has been away for long: the oldest writes are enough to keep
        self._dirty[session_id] = binding
        self._wake.set()

    async def run(self) -> None:
        """Follows etcd and writes this router's bindings, until cancelled."""
        await asyncio.gather(follow_prefix(self._store, self._prefix, self._listed, self._watched), self._write())

    # -- writing ---------------------------------------------------------------------------------

    async def _write(self) -> None:
        backoff = 0.2
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._dirty:
                batch = list(itertools.islice(self._dirty.items(), WRITE_BATCH))
                try:
                    lease = await self._current_lease()
                    for session_id, binding in batch:
                        await self._store.put(self._prefix + session_id, encode(binding), lease)
                        if self._dirty.get(session_id) is binding:
                            del self._dirty[session_id]
                        # As the watch will echo it back (encode rounds), so the echo is known ours.
                        self._written[session_id] = Binding(binding.worker_id, round(binding.expires_at, 3))
                        if len(self._written) > MAX_BINDINGS:
                            del self._written[next(iter(self._written))]
                    backoff = 0.2
                except StoreUnavailable as exc:
                    log.warning("session bindings not written to etcd (%s); %d waiting, retrying in %.1fs", exc,
                                len(self._dirty), backoff)
                    self._lease = None
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _current_lease(self) -> int:
        now = asyncio.get_running_loop().time()
        if self._lease is None or now - self._lease[1] >= self.refresh_s:
            lease_id = await self._store.grant_lease(int(self._ttl_s + 2 * self.refresh_s) + 1)
            self._lease = (lease_id, now)
        return self._lease[0]

    # -- following -------------------------------------------------------------------------------

    def _listed(self, items: list[KeyValue]) -> None:
        for kv in items:
            self._learn(kv.key, kv.value)

    def _watched(self, event: WatchEvent) -> None:
        if not event.deleted:
            self._learn(event.key, event.value)
            return
        session_id = event.key[len(self._prefix):]
        self._written.pop(session_id, None)
        # Forgotten only if it ran out (or nearly): not one renewed since.
        self._bindings.forget(session_id, within_s=self.refresh_s)

    def _learn(self, key: str, value: bytes) -> None:
        binding = decode(value)
        if binding is None:
            log.warning("ignoring malformed session binding %s", key)
            return
        session_id = key[len(self._prefix):]
        if self._written.get(session_id) != binding:
            # Another replica's (or an old one of ours): what etcd holds is no longer what we
            # wrote, so our next binding of the session must be written whatever its age.
            self._written.pop(session_id, None)
        self._bindings.learn(session_id, binding)


async def follow_sessions(runner: ServiceRunner, namespace: str, config: SessionConfig) -> SessionBindings | None:
    """A routing process's session bindings, mirrored in etcd by a task the runner owns (None
    with sessions off: nothing bound, nothing kept)."""
    bindings = SessionBindings(config)
    if not bindings.active:
        return None
    store = SessionStore(runner.store, namespace, bindings)
    runner.watch(asyncio.create_task(store.run(), name="session bindings"), "session bindings")
    return bindings
