"""Which `KvIndex` a router holds: the native one (C, services/routing/native/) where it was built
and imports, else the Python `RadixTree`, with one line saying why: a WARNING where it was built
but does not import (stale, or broken), INFO where it was never built.

Both give the same scores for the same events (tests/unit/test_radix_tree.py checks each against
the reference model); on the indexer benchmark's trace the native one applies events over 3x
faster, answers a 4k-token query about 4x faster and holds a block in about half the memory.
`KVMESH_INDEX=python` forces the Python one (to compare, or to rule the C out).
"""

from __future__ import annotations

import logging
import os

from services.routing.kv_index import KvIndex
from services.routing.radix_tree import RadixTree

log = logging.getLogger(__name__)

ENV = "KVMESH_INDEX"


def new_index() -> KvIndex:
    """A fresh, empty index: native unless forced to Python or not built."""
    if os.environ.get(ENV, "").strip().lower() == "python":
        log.info("KV index: the Python radix tree (%s=python)", ENV)
        return RadixTree()
    try:
        from services.routing.native.native_radix_tree import NativeRadixTree
    except ImportError as exc:
        if _native_built():  # stale (older sources) or broken: someone meant it to run
            log.warning("KV index: the Python radix tree, the native one was built but does not import (%s); "
                        "rebuild it with `make install` or `python -m services.routing.native.build`", exc)
        else:
            log.info("KV index: the Python radix tree, the native one was never built (%s); "
                     "build it with `python -m services.routing.native.build`", exc)
        return RadixTree()
    return NativeRadixTree()


def _native_built() -> bool:
    """Whether the native index's shared object is there (build.py's output)."""
    from services.routing.native.build import target

    return target().exists()
