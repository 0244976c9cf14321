"""The router's index on the conversation trace with both KV tiers held: bytes per held block.

Four mocker block managers (the tiers benchmark's sizes: 4,096 device blocks of 64 tokens and a
host tier of 8x that each) take the Mooncake conversation trace in order, each request going to
the worker whose tiers hold over half the prompt, else to the next in turn, and send their KV
events to one radix tree, as a router's would. Requests finish at once, so what they leave is
what the caches hold. Memory is counted with tracemalloc: every allocation made in the index's
modules and still live. Run as `python -m bench.tiers.index`; the last stdout line is one JSON
object.
"""

from __future__ import annotations

import json
import sys
import time
import tracemalloc
from collections.abc import Sequence
from functools import partial

from bench.tiers.mooncake_trace import TraceRequest, load
from services.engines.mocker.block_manager import BlockManager
from services.routing.kv_index import apply_kv_event
from services.routing.radix_tree import RadixTree
from services.kv_protocol.hashing import chained_block_hashes, local_block_hashes

WORKERS = 4
BLOCK_SIZE = 64
DEVICE_BLOCKS = 4096
HOST_BLOCKS = 8 * DEVICE_BLOCKS


def simulate(requests: Sequence[TraceRequest], tree: RadixTree, workers: int, device_blocks: int,
             host_blocks: int, block_size: int = BLOCK_SIZE) -> float:
    """Runs the trace through `workers` block managers whose events feed `tree`; returns the
    share of prompt tokens reused from either tier. A request goes to the worker whose tiers hold
    over half its prompt, otherwise to the next in turn, so every worker's tiers fill."""
    managers = [BlockManager(device_blocks, block_size, partial(apply_kv_event, tree, w), host_blocks)
                for w in range(workers)]
    reused = total = 0
    for n, request in enumerate(requests):
        tokens = list(request.token_ids)
        locals_ = local_block_hashes(tokens, block_size)
        device, host = tree.find_matches_by_tier(locals_)
        best = max(range(workers), key=lambda w: device.get(w, 0) + host.get(w, 0))
        held_blocks = device.get(best, 0) + host.get(best, 0)
        worker = best if 2 * held_blocks > len(locals_) else n % workers
        allocation = managers[worker].allocate(chained_block_hashes(tokens, block_size), locals_, len(tokens))
        total += len(tokens)
        if allocation is not None:
            blocks, hit, loaded = allocation
            reused += (hit + loaded) * block_size
            managers[worker].free(blocks)
        if n % 250 == 0:
            print(f"tiers simulation: {n:,}/{len(requests):,} requests", file=sys.stderr, flush=True)
    return reused / total if total else 0.0


def pooled_bound(requests: Sequence[TraceRequest], workers: int, device_blocks: int, host_blocks: int,
                 block_size: int) -> float:
    """Reuse of one LRU cache holding all the workers' device and host blocks together: what
    routing could reach if it never had to spread load (no conversation split across workers)."""
    return simulate(requests, RadixTree(), 1, workers * device_blocks, workers * host_blocks, block_size)


def main() -> None:
    requests = load()
    tracemalloc.start()
    tree = RadixTree()
    t0 = time.perf_counter()
    simulate(requests, tree, WORKERS, DEVICE_BLOCKS, HOST_BLOCKS)
    seconds = time.perf_counter() - t0
    held = tree.block_count()
    device_held = sum(tree.block_count(w) for w in range(WORKERS))
    # What the index holds: every allocation made in the index's modules and still live (at this
    # size, memory a dropped index frees mostly stays with the allocator, so RSS cannot tell).
    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*/services/routing/*")])
    index_bytes = sum(stat.size for stat in snapshot.statistics("filename"))
    print(json.dumps({"requests": len(requests), "blocks_held": held, "device_blocks_held": device_held,
                      "host_blocks_held": held - device_held, "bytes_per_held_block": index_bytes / held if held else 0.0,
                      "simulate_s": seconds}))


if __name__ == "__main__":
    main()
