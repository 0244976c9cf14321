"""The router's index on the conversation trace with both KV tiers held: bytes per held block.

Four mocker block managers (the tiers benchmark's sizes: 4,096 device blocks of 64 tokens and a
host tier of 8x that each) take the Mooncake conversation trace in order, each request going to
the worker whose tiers hold over half the prompt, else to the next in turn, and send their KV
events to one radix tree, as a router's would. Requests finish at once, so what they leave is
what the caches hold. Memory is counted with tracemalloc: every allocation made in the index's
modules and still live. Run as `python -m bench.tiers_index`; the last stdout line is one JSON
object.
"""

from __future__ import annotations

import tracemalloc
import json
import sys
import time
from collections.abc import Callable

from bench.mooncake_trace import load
from services.engines.base import KvEventData, KvRemoved, KvStored
from services.engines.mocker.block_manager import BlockManager
from services.kv_router.radix_tree import RadixTree
from services.mesh.hashing import chained_block_hashes, local_block_hashes

WORKERS = 4
BLOCK_SIZE = 64
DEVICE_BLOCKS = 4096
HOST_BLOCKS = 8 * DEVICE_BLOCKS


def sink(index: list[RadixTree], worker: int) -> Callable[[KvEventData], None]:
    """Applies a worker's events to `index[0]` (a box, so the tree can be dropped alone)."""
    def apply(data: KvEventData) -> None:
        tree = index[0]
        if isinstance(data, KvStored):
            tree.store(worker, data.parent_hash, data.blocks, data.tier)
        elif isinstance(data, KvRemoved):
            tree.remove(worker, data.block_hashes, data.tier)
        else:
            tree.clear(worker)
    return apply


def main() -> None:
    requests = load()
    tracemalloc.start()
    tree = RadixTree()
    box = [tree]
    managers = [BlockManager(DEVICE_BLOCKS, BLOCK_SIZE, sink(box, w), HOST_BLOCKS) for w in range(WORKERS)]
    apply_s = 0.0
    for n, request in enumerate(requests):
        tokens = list(request.token_ids)
        locals_ = local_block_hashes(tokens, BLOCK_SIZE)
        device, host = tree.find_matches_by_tier(locals_)
        # The longest prefix held, where it is over half the prompt; otherwise in turn, so every
        # worker's tiers fill.
        best = max(range(WORKERS), key=lambda w: device.get(w, 0) + host.get(w, 0))
        held_blocks = device.get(best, 0) + host.get(best, 0)
        worker = best if 2 * held_blocks > len(locals_) else n % WORKERS
        t0 = time.perf_counter()
        allocation = managers[worker].allocate(chained_block_hashes(tokens, BLOCK_SIZE), locals_, len(tokens))
        if allocation is not None:
            managers[worker].free(allocation[0])
        apply_s += time.perf_counter() - t0
        if n % 250 == 0:
            print(f"tiers index: {n:,}/{len(requests):,} requests", file=sys.stderr, flush=True)
    held = tree.block_count()
    device_held = sum(tree.block_count(w) for w in range(WORKERS))
    # What the index holds: every allocation made in the index's modules and still live (at this
    # size, memory a dropped index frees mostly stays with the allocator, so RSS cannot tell).
    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*/services/kv_router/*")])
    index_bytes = sum(stat.size for stat in snapshot.statistics("filename"))
    print(json.dumps({"requests": len(requests), "blocks_held": held, "device_blocks_held": device_held,
                      "host_blocks_held": held - device_held, "bytes_per_held_block": index_bytes / held if held else 0.0,
                      "simulate_s": apply_s}))


if __name__ == "__main__":
    main()
