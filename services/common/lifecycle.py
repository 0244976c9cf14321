"""Process lifecycle shared by every service: signals, etcd connection, one-line fatal errors."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Coroutine
from typing import Any

from services.common.config import MeshConfig, die
from services.common.discovery import InstanceInfo, instance_key
from services.common.etcd_lease import LeasedRegistration
from services.common.etcd_store import EtcdStore, KeyValueStore, StoreUnavailable

log = logging.getLogger(__name__)


def stop_event_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT, so services shut down cleanly on either."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def connect_store(mesh: MeshConfig) -> EtcdStore:
    store = EtcdStore(mesh.etcd_endpoints)
    try:
        await store.connect()
    except StoreUnavailable as exc:
        die(f"{exc} (start etcd or pass --etcd-endpoints)", code=3)
    return store


async def register_instance(store: KeyValueStore, namespace: str, info: InstanceInfo,
                            extra_keys: dict[str, bytes] | None = None) -> LeasedRegistration:
    """Registers this instance (and any keys that live and die with it) under a kept-alive lease,
    or exits with a one-line reason."""
    registration = LeasedRegistration(store)
    try:
        await registration.start({**(extra_keys or {}), instance_key(namespace, info): info.to_json()})
    except StoreUnavailable as exc:
        die(f"etcd registration failed: {exc}", code=3)
    return registration


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Runs a service's async main on uvloop when available."""
    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
