"""NVIDIA Dynamo's RadixTree replayed over the indexer trace, as `python -m services.kv_router
replay` replays kvmesh's indexes: run by the Dynamo baseline's interpreter (stdlib and `dynamo`
only, no kvmesh import), it prints the same JSON fields on its last stdout line.

    .cache/bench/dynamo-1.6.1/bin/python bench/indexer/dynamo_replay.py EVENTS QUERIES BLOCK_SIZE [--out SCORES]

What each timing includes, so the two sides are measured alike:
- `blocks_per_s`: `RadixTree.apply_event(worker_id, event_bytes)` over every event, the bytes
  encoded before the clock starts. Dynamo's apply takes serialized JSON, so its serde parse of
  the event is part of its apply; kvmesh's includes building the (hash, hash) pairs from each
  decoded event, but not the JSON decoding of the trace line (`decode_blocks_per_s` there).
  Blocks are the ones each event names (the trace has no event either side skips).
- `query_p50_us`/`query_p99_us`: `find_matches` on the query's local block hashes, computed
  before the clock starts (Dynamo's `compute_block_hash_for_seq`, the same xxh3 hashes kvmesh
  computes); `hash_p50_us`/`hash_p99_us` time that hashing alone.
- `bytes_per_held_block`: the resident memory the process gives back when the tree is dropped,
  over the blocks held (the trace's held blocks, counted from its events; Dynamo has no count).
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path

from dynamo.llm import RadixTree, compute_block_hash_for_seq


def rss_mb(field: str = "VmRSS") -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024.0
    return 0.0


def percentile(values: list[float], q: float) -> float:
    """Nearest rank, as services.profiles.stats.percentile."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def main(argv: list[str]) -> None:
    events_path, queries_path, block_size = Path(argv[0]), Path(argv[1]), int(argv[2])
    out_path = Path(argv[4]) if len(argv) > 4 and argv[3] == "--out" else None
    events: list[tuple[int, bytes]] = []
    held: dict[int, set[int]] = {}
    blocks = 0
    with events_path.open("rb") as f:
        for line in f:
            if not line.strip():
                continue
            record = json.loads(line)
            worker, data = record["worker_id"], record["event"]["data"]
            mine = held.setdefault(worker, set())
            if data == "cleared":
                mine.clear()
            elif "stored" in data:
                hashes = [b["block_hash"] for b in data["stored"]["blocks"]]
                mine.update(hashes)
                blocks += len(hashes)
            else:
                hashes = data["removed"]["block_hashes"]
                mine.difference_update(hashes)
                blocks += len(hashes)
            events.append((worker, json.dumps(record["event"]).encode()))
    blocks_held = sum(len(s) for s in held.values())
    del held
    gc.collect()

    tree = RadixTree()
    skipped = 0
    t0 = time.perf_counter()
    for worker, event in events:
        try:
            tree.apply_event(worker, event)
        except RuntimeError:  # an event Dynamo refuses (unknown parent): skipped, as kvmesh skips it
            skipped += 1
    tree.find_matches([])  # a barrier: every event applied (apply_event is synchronous already)
    apply_s = time.perf_counter() - t0
    n_events = len(events)
    del events
    gc.collect()

    latencies_us: list[float] = []
    hash_us: list[float] = []
    out = out_path.open("w") if out_path else None
    with queries_path.open("rb") as f:
        for line in f:
            if not line.strip():
                continue
            q = json.loads(line)
            t0 = time.perf_counter()
            local_hashes = compute_block_hash_for_seq(q["token_ids"], block_size)
            t1 = time.perf_counter()
            scores = tree.find_matches(local_hashes)
            t2 = time.perf_counter()
            hash_us.append((t1 - t0) * 1e6)
            latencies_us.append((t2 - t1) * 1e6)
            if out is not None:
                by_worker = {str(worker): n for (worker, _rank), n in scores.scores.items()}
                out.write(json.dumps({"query_id": q["query_id"], "scores": by_worker}) + "\n")
    if out is not None:
        out.close()
    peak_rss = rss_mb("VmHWM")
    holding_rss = rss_mb()
    del tree
    gc.collect()
    time.sleep(0.5)  # its background thread lets go of the tree
    index_bytes = (holding_rss - rss_mb()) * 1024 * 1024
    print(json.dumps({
        "index": "dynamo",
        "events_applied": n_events,
        "events_skipped": skipped,
        "blocks_applied": blocks,
        "blocks_held": blocks_held,
        "blocks_per_s": blocks / apply_s if apply_s else 0.0,
        "queries": len(latencies_us),
        "query_p50_us": percentile(latencies_us, 50),
        "query_p99_us": percentile(latencies_us, 99),
        "hash_p50_us": percentile(hash_us, 50),
        "hash_p99_us": percentile(hash_us, 99),
        "peak_rss_mb": peak_rss,
        "bytes_per_held_block": index_bytes / blocks_held if blocks_held else 0.0,
    }))


if __name__ == "__main__":
    main(sys.argv[1:])
