"""Following everything under an etcd prefix: a listing, then a watch from the listing's revision;
a broken watch is set up again from a fresh listing, after a backoff. Discovery's component views
and the routers' session bindings both follow their keys this way."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import NoReturn

from services.mesh.etcd_store import KeyValue, KeyValueStore, StoreUnavailable, WatchEvent, WatchNotConfirmed

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 0.2
BACKOFF_MAX_S = 5.0
# Watches in a row etcd may leave unconfirmed before it is worth a WARNING.
UNCONFIRMED_WARN = 3


async def follow_prefix(store: KeyValueStore, prefix: str, on_listing: Callable[[list[KeyValue]], None],
                        on_event: Callable[[WatchEvent], None]) -> NoReturn:
    """Hands every listing of `prefix` to `on_listing` (the whole of it: what is not in it is gone)
    and every change the watch reports after it to `on_event`, until cancelled.

    The wait before relisting doubles, up to BACKOFF_MAX_S, while etcd cannot be listed; a
    listing that succeeds starts it again from BACKOFF_MIN_S, so a watch that breaks as etcd comes
    back is set up again at once (members return to the views within the lease TTL)."""
    backoff = BACKOFF_MIN_S
    unconfirmed = 0  # watches in a row etcd did not confirm in time
    while True:
        try:
            items, revision = await store.get_prefix(prefix)
            on_listing(items)
            backoff = BACKOFF_MIN_S
            async for event in store.watch_prefix(prefix, revision + 1):
                unconfirmed = 0
                on_event(event)
        except WatchNotConfirmed as exc:
            # Routine once on a busy machine; not when etcd keeps not confirming.
            unconfirmed += 1
            log.log(logging.INFO if unconfirmed < UNCONFIRMED_WARN else logging.WARNING, "%s (%d in a row); relisting",
                    exc, unconfirmed)
        except StoreUnavailable as exc:
            log.warning("watch on %s broke (%s); relisting", prefix, exc)
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, BACKOFF_MAX_S)
