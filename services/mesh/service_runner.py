"""The one way a kvmesh process is assembled and torn down.

Rule: a service acquires its resources inside `assemble(runner)` and registers each one's
teardown with the runner right after acquiring it. The runner tears them down in exactly the
reverse order — after SIGTERM/SIGINT, after a start-up failure, after an unexpected exception,
and when a task the service asked it to watch ends. Every teardown step has a deadline; a step
that fails or overruns is logged and the remaining steps still run, so a stuck gRPC server can
never keep a lease alive or an engine process running.

SIGTERM drains, by the same reverse order: the lease goes first (peers stop choosing this
instance), then a short propagation delay (requests already routed here still arrive and are
served), then servers stop taking new calls (gRPC answers UNAVAILABLE, and sessions refuse
new calls with OUTCOME_PEER_DRAINING, which callers retry elsewhere) and give those in flight up
to `--drain-timeout` to finish; what is still running then is cancelled (a decode worker's
callers move it to another worker).

Exit status: 0 after a stop signal, the `SystemExit` code of a deliberate exit (bad flags 2,
etcd unreachable 3), 1 after a crash or a watched task that ended.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
from http.server import ThreadingHTTPServer
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from typing import Any

from grpc_health.v1 import health
from prometheus_client import CollectorRegistry

from services.mesh.channels import ChannelPool
from services.mesh.discovery import ComponentView, InstanceInfo, instance_key
from services.mesh.etcd_lease import LeasedRegistration
from services.mesh.etcd_store import EtcdStore, KeyValueStore, StoreUnavailable
from services.mesh.config_error import EXIT_UNREACHABLE, die
from services.mesh.flags import MeshConfig
from services.mesh.gc_pauses import GcPauses
from services.mesh.grpc_server import ServiceBinding, start_server
from services.mesh.metrics_http import serve_metrics
from services.mesh.session_carrier import CarrierDialer, CarrierListener, endpoint_binding
from services.mesh.session_client import SessionPool
from services.mesh.session_server import SessionHub
from services.mesh.tasks import cancel_and_wait

log = logging.getLogger(__name__)

# A teardown step that takes longer is abandoned (and logged) so the next one still runs.
TEARDOWN_STEP_S = 10.0
# After deregistering, how long peers get to notice (an etcd watch delivers within milliseconds;
# a request routed just before still reaches us and is served).
PROPAGATION_DELAY_S = 1.0
# The event loop proves it runs by a heartbeat; /live fails once the last one is this old (a
# deadlocked or wedged loop, which a thread serving the side port would not notice).
HEARTBEAT_S = 1.0
LIVENESS_STALE_S = 15.0

Teardown = Callable[[], Awaitable[object] | None]


@dataclass(frozen=True, slots=True)
class _Step:
    label: str
    action: Teardown
    timeout_s: float


class ServiceRunner:
    """Owns one process's resources: registered in start order, torn down in reverse."""

    def __init__(self, component: str, mesh: MeshConfig | None = None) -> None:
        self.component = component
        self.mesh = mesh
        self.exit_code = 0
        self._tearing_down = False
        self._steps: list[_Step] = []
        self._stop = asyncio.Event()
        # Assembled and not stopping: what the side port's /health reports.
        self._serving = False
        self._heartbeat = time.monotonic()
        self._store: KeyValueStore | None = None
        self._channels: ChannelPool | None = None
        self._sessions: SessionPool | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    def on_teardown(self, label: str, action: Teardown, timeout_s: float = TEARDOWN_STEP_S) -> None:
        """Registers the teardown of something just acquired; it runs before everything acquired earlier."""
        self._steps.append(_Step(label, action, timeout_s))

    def request_stop(self, reason: str, exit_code: int = 0) -> None:
        self._serving = False
        if not self._stop.is_set():
            log.info("%s stopping: %s", self.component, reason)
            self.exit_code = exit_code
            self._stop.set()

    @property
    def stopping(self) -> bool:
        """A stop was asked for, or the teardown began (after a failure): watched tasks that end
        now are being ended, not failing."""
        return self._stop.is_set() or self._tearing_down

    def watch(self, task: asyncio.Task[Any], label: str) -> asyncio.Task[Any]:
        """A background task the service cannot live without: when it ends, the service stops
        (exit 1 unless a stop was already under way); cancelled at teardown."""

        def ended(t: asyncio.Task[Any]) -> None:
            if self.stopping:
                return
            if t.cancelled():
                self.request_stop(f"{label} was cancelled", 1)
            elif (exc := t.exception()) is not None:
                log.error("%s failed: %s", label, exc, exc_info=exc)
                self.request_stop(f"{label} failed", 1)
            else:
                self.request_stop(f"{label} ended", 1)

        task.add_done_callback(ended)
        self.on_teardown(f"cancel {label}", lambda: cancel_and_wait(task))
        return task

    async def serve(self, assemble: Callable[[ServiceRunner], Awaitable[None]]) -> int:
        """Assembles the service, runs it until a stop, tears it down; returns the exit status."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, signal.Signals(sig).name)
        beating = asyncio.create_task(self._beat(), name="heartbeat")
        self.on_teardown("stop the heartbeat", lambda: cancel_and_wait(beating))
        try:
            await self._assemble(assemble)
            self._serving = not self._stop.is_set()
            freeze_start_up_objects()
            await self._stop.wait()
        except _Exit as exc:
            self.exit_code = exc.code
        except Exception as exc:  # noqa: BLE001 - any crash still ends in an orderly teardown
            log.critical("%s crashed: %s", self.component, exc, exc_info=exc)
            self.exit_code = 1
        finally:
            await self._teardown()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            # Frozen objects are never freed, not even at exit, where native extensions (triton's,
            # under vLLM) then report them as leaked.
            gc.unfreeze()
        return self.exit_code

    async def _beat(self) -> None:
        while True:
            self._heartbeat = time.monotonic()
            await asyncio.sleep(HEARTBEAT_S)

    def alive(self) -> bool:
        return time.monotonic() - self._heartbeat < LIVENESS_STALE_S

    async def _assemble(self, assemble: Callable[[ServiceRunner], Awaitable[None]]) -> None:
        """Runs `assemble`, abandoning it if a stop signal comes first (a vLLM load takes a while)."""
        building = asyncio.ensure_future(self._guarded(assemble))
        stopped = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait([building, stopped], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if not building.done():
            log.info("%s: stop requested during start-up", self.component)
            await cancel_and_wait(building)
            return
        building.result()

    async def _guarded(self, assemble: Callable[[ServiceRunner], Awaitable[None]]) -> None:
        # SystemExit escaping a task would also escape the event loop and skip the teardown.
        try:
            await assemble(self)
        except SystemExit as exc:
            raise _Exit(exc.code if isinstance(exc.code, int) else 1) from None

    async def _teardown(self) -> None:
        self._tearing_down = True
        while self._steps:
            step = self._steps.pop()
            try:
                result = step.action()
                if result is not None:
                    await asyncio.wait_for(result, step.timeout_s)
            except TimeoutError:
                log.error("%s: teardown step '%s' overran %.0fs; abandoned", self.component, step.label, step.timeout_s)
            except Exception as exc:  # noqa: BLE001 - logged; the remaining steps must still run
                log.error("%s: teardown step '%s' failed: %s", self.component, step.label, exc, exc_info=exc)

    # -- the resources most services acquire --------------------------------------------------

    @property
    def store(self) -> KeyValueStore:
        if self._store is None:
            raise RuntimeError("connect_store() first")
        return self._store

    @property
    def channels(self) -> ChannelPool:
        """Client channels to other instances, one per address, closed at teardown."""
        if self._channels is None:
            self._channels = pool = ChannelPool(self.mesh.tls if self.mesh is not None else None)
            self.on_teardown("close client channels", pool.close)
        return self._channels

    @property
    def sessions(self) -> SessionPool:
        """Sessions to other instances (many calls on one stream per peer), closed at teardown
        before the channels they use."""
        if self._sessions is None:
            channels = self.channels
            mesh = self.mesh
            dialer = None
            if mesh is None or mesh.session_carrier == "tcp":
                dialer = CarrierDialer(channels, mesh.tls if mesh is not None else None)
            self._sessions = pool = SessionPool(channels, dialer=dialer)
            self.on_teardown("close sessions", pool.close)
        return self._sessions

    def _mesh(self) -> MeshConfig:
        if self.mesh is None:
            raise RuntimeError(f"{self.component} runs without a mesh config")
        return self.mesh

    async def connect_store(self) -> KeyValueStore:
        """Connects to etcd or exits with status 3 and a one-line reason; once per process (a
        gateway hosting a processor asks for both)."""
        if self._store is not None:
            return self._store
        store = EtcdStore(self._mesh().etcd_endpoints, tls=self._mesh().tls)
        try:
            await store.connect()
        except StoreUnavailable as exc:
            die(f"{exc} (start etcd or pass --etcd-endpoints)", code=EXIT_UNREACHABLE)
        self._store = store
        self.on_teardown("close etcd client", store.close)
        return store

    async def register(self, info: InstanceInfo, extra_keys: dict[str, bytes] | None = None) -> LeasedRegistration:
        """Registers the instance (and keys that live and die with it) under a kept-alive lease.

        Registered last during assembly, so it is the first thing torn down: peers stop
        choosing this instance before its servers close."""
        (registration,) = await self.register_all([(info, extra_keys or {})])
        return registration

    async def register_all(self, entries: Sequence[tuple[InstanceInfo, dict[str, bytes]]]) -> list[LeasedRegistration]:
        """`register` for several instances of one process (mocker workers): at a drain they all
        leave etcd, then peers get one propagation delay, then their servers stop together."""
        self.on_teardown("let peers notice the departure", self._propagation_delay)
        return [await self._register_one(info, keys) for info, keys in entries]

    async def _propagation_delay(self) -> None:
        if self._stop.is_set():  # a drain: let peers see we are gone before servers stop
            await asyncio.sleep(min(PROPAGATION_DELAY_S, self.drain_timeout_s))

    async def _register_one(self, info: InstanceInfo, extra_keys: dict[str, bytes]) -> LeasedRegistration:
        registration = LeasedRegistration(self.store)
        key = instance_key(self._mesh().namespace, info)
        keys = {**(extra_keys or {}), key: info.to_json()}
        try:
            await registration.start(keys)
        except StoreUnavailable as exc:
            die(f"etcd registration failed: {exc}", code=EXIT_UNREACHABLE)
        registration.farewell[key] = replace(info, leaving=True).to_json()
        self.on_teardown(f"deregister {info.component} {info.instance_id}", registration.stop)
        if registration.keep_alive_task is not None:
            self.watch(registration.keep_alive_task, f"the lease keep-alive of {info.instance_id}")
        return registration

    async def watch_component(self, component: str) -> ComponentView:
        """A live view of one component's instances, stopped at teardown."""
        view = ComponentView(self.store, self._mesh().namespace, component)
        watching = await view.start()
        self.on_teardown(f"stop {component} view", view.stop)
        self.watch(watching, f"the {component} watch")
        return view

    @property
    def drain_timeout_s(self) -> float:
        return self.mesh.drain_timeout_s if self.mesh is not None else 0.0

    async def serve_grpc(self, bindings: Sequence[ServiceBinding], port: int = 0) -> tuple[int, health.HealthServicer]:
        """Starts a gRPC server with health (reflection if asked, mTLS if configured); returns its
        port and health servicer.

        At teardown it first reports NOT_SERVING, then stops: new calls are refused at once,
        calls in flight get the drain timeout to finish."""
        mesh = self._mesh()
        # A session carries many calls and never ends by itself: it refuses new calls and ends
        # once its calls have, like the server does with whole calls.
        hubs = [b.servicer.sessions for b in bindings if isinstance(getattr(b.servicer, "sessions", None), SessionHub)]
        # The sessions are served on a TCP port of their own too (session_carrier.py), which
        # the gRPC server tells callers.
        carrier = CarrierListener(hubs, mesh.tls) if hubs else None
        if carrier is not None:
            bindings = [*bindings, endpoint_binding(await carrier.start(mesh.host))]
        server, bound, health_servicer = await start_server(bindings, mesh.host, port, tls=mesh.tls,
                                                            reflect=mesh.grpc_reflection)
        grace = self.drain_timeout_s

        async def stop() -> None:
            for hub in hubs:
                hub.drain()
            await asyncio.gather(server.stop(grace=grace), *([carrier.stop(grace)] if carrier is not None else []))

        self.on_teardown("stop gRPC server", stop, grace + TEARDOWN_STEP_S)
        self.on_teardown("report NOT_SERVING", health_servicer.enter_graceful_shutdown)
        return bound, health_servicer

    @property
    def serving(self) -> bool:
        return self._serving

    def serve_metrics(self, registry: CollectorRegistry, port: int = 0) -> int:
        """Serves /metrics, /health (200 while serving) and /live (200 while the event loop runs)
        on a side port, with the process's garbage-collector pauses; returns the port."""
        self.time_gc(registry)
        host = self._mesh().host
        try:
            server = serve_metrics(registry, host, port, ready=lambda: self._serving, alive=self.alive)
        except OSError as exc:
            die(f"--metrics-port {port}: cannot listen on {host}:{port} ({exc.strerror})")
        self.on_teardown("close the metrics port", lambda: asyncio.to_thread(_close_http, server))
        return int(server.server_port)

    def time_gc(self, registry: CollectorRegistry) -> None:
        """The process's garbage-collector pauses in `registry` (gc_pauses.py), until teardown."""
        pauses = GcPauses(registry)
        pauses.install()
        self.on_teardown("stop timing garbage collections", pauses.remove)


def freeze_start_up_objects() -> None:
    """Leaves what start-up built (modules, the tokenizer, an engine's tables: 360k objects in a
    processor) out of every later garbage collection. A full collection walks every tracked
    object; over those it took ~170 ms, and one landing in the middle of a stream stalls every
    stream of the process: the ITL spikes of a busy mesh. Objects made later are collected as
    before."""
    gc.collect()
    gc.freeze()


def _close_http(server: ThreadingHTTPServer) -> None:
    server.shutdown()  # ends serve_forever (within its 0.5 s poll)
    server.server_close()


class _Exit(Exception):
    """A deliberate exit (`die`) during assembly, carried out of the assembling task."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def run_service(component: str, mesh: MeshConfig | None,
                assemble: Callable[[ServiceRunner], Awaitable[None]]) -> None:
    """The entry point of every service: serve until stopped, then exit with the runner's status."""
    code = run(lambda: ServiceRunner(component, mesh).serve(assemble))
    raise SystemExit(code)


def run(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Runs an async main on uvloop when available; returns its result (130 after Ctrl-C)."""
    try:
        import uvloop
    except ImportError:
        return _run_ignoring_interrupt(lambda: asyncio.run(main()))
    return _run_ignoring_interrupt(lambda: uvloop.run(main()))


def _run_ignoring_interrupt(call: Callable[[], int]) -> int:
    try:
        return call()
    except KeyboardInterrupt:
        return 130
