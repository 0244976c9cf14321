"""Offline replay: build an index from recorded router events, then score recorded queries.

    python -m services.kv_router replay --events EVENTS.jsonl --queries QUERIES.jsonl \\
        --block-size N [--index router|native|radix|reference] [--out SCORES.jsonl]

Events use Dynamo's router-event JSON; the last stdout line is one JSON object of measurements.
`blocks_per_s` counts only applying decoded events to the index (as a router does with events
already off the wire: the (hash, hash) pairs built from each decoded event, and the index's
store or remove); `decode_blocks_per_s` is the JSON decoding of the same lines;
`query_p50_us`/`query_p99_us` time `find_matches` on a query's local block hashes, computed
before the clock starts (the same hashes for any index; `hash_p50_us`/`hash_p99_us` time that
hashing of the query's tokens on its own); `bytes_per_held_block` is the resident memory the
process gives back when the index is dropped, over the blocks it held (`peak_rss_mb` also counts
decoded events and passing buffers). The native index unmaps its large arrays and trims the C
heap when dropped, so the same measure holds for it.

`--index router` (the default) is the index a router serves with, chosen as the router chooses it
(index_choice.py: the native one, else the Python radix tree; `KVMESH_INDEX=python` forces it);
`--index native` the router's index in C (services/routing/native/, built at install), and an
error where it was not built; `--index radix` the Python radix tree the router falls back to where
the C one was not built; `--index reference` the naive reference index: the benchmark's
baseline, and a check that they all give the same scores for the same trace. The summary's
`index` names the one that ran (`native` or `radix` for `router`).
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from services.mesh.flags import FlagParser
from services.kv_protocol.hashing import SequenceHash, local_block_hashes
from services.profiles.stats import percentile
from services.routing.index_choice import new_index
from services.routing.kv_index import EventError, KvIndex, StoredBlock
from services.routing.radix_tree import RadixTree
from services.routing.reference_index import ReferenceIndex

CHUNK_LINES = 4_000


def native_index() -> KvIndex:
    try:
        from services.routing.native.native_radix_tree import NativeRadixTree
    except ImportError as exc:
        raise SystemExit(f"error: the native index is not built ({exc}); "
                         "run `python -m services.routing.native.build`") from None
    return NativeRadixTree()


INDEXES: dict[str, Callable[[], KvIndex]] = {"router": new_index, "native": native_index, "radix": RadixTree,
                                             "reference": ReferenceIndex}


def parser() -> argparse.ArgumentParser:
    p = FlagParser(prog="python -m services.kv_router replay", description=__doc__.splitlines()[0])
    p.add_argument("--events", type=Path, required=True)
    p.add_argument("--queries", type=Path, required=True)
    p.add_argument("--block-size", type=int, required=True)
    p.add_argument("--index", choices=tuple(INDEXES), default="router",
                   help="the index to replay through: the one a router serves with (router: native where built, "
                        "else radix), the router's index in C (native), the Python radix tree it falls back to "
                        "(radix), or the naive reference")
    p.add_argument("--out", type=Path, default=None, help="write per-query scores here (JSONL)")
    return p


def _chunks(path: Path) -> Iterator[list[bytes]]:
    with path.open("rb") as f:
        chunk: list[bytes] = []
        for line in f:
            if line.strip():
                chunk.append(line)
                if len(chunk) >= CHUNK_LINES:
                    yield chunk
                    chunk = []
        if chunk:
            yield chunk


def apply_event(tree: KvIndex, record: dict[str, Any]) -> int:
    """Applies one Dynamo router event; returns the number of blocks it stored or removed."""
    worker = record["worker_id"]
    data = record["event"]["data"]
    if data == "cleared":
        tree.clear(worker)
        return 0
    if "stored" in data:
        stored = data["stored"]
        blocks: list[StoredBlock] = [(b["block_hash"], b["tokens_hash"]) for b in stored["blocks"]]
        parent: SequenceHash | None = stored.get("parent_hash")
        try:
            return tree.store(worker, parent, blocks)
        except EventError:
            return 0
    if "removed" in data:
        removed: list[SequenceHash] = data["removed"]["block_hashes"]
        return tree.remove(worker, removed)
    raise ValueError(f"unknown event data: {data!r}")


def rss_mb(field: str = "VmHWM") -> float:
    """This process's resident memory in MB: its peak (VmHWM; getrusage's maximum survives exec)
    or, with "VmRSS", what it holds now."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def main(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    if args.block_size <= 0:
        raise SystemExit("error: --block-size must be > 0")
    tree = INDEXES[args.index]()
    index = args.index
    if index == "router":  # the summary names the one the router's choice gave
        index = "radix" if isinstance(tree, RadixTree) else "native"
    decode = msgspec.json.Decoder()
    events = blocks = 0
    apply_s = decode_s = 0.0
    for number, chunk in enumerate(_chunks(args.events)):
        t0 = time.perf_counter()
        try:
            records = [decode.decode(line) for line in chunk]
        except msgspec.DecodeError as exc:
            raise SystemExit(f"error: {args.events}: malformed JSON near line {number * CHUNK_LINES}: {exc}") from None
        t1 = time.perf_counter()
        for record in records:
            blocks += apply_event(tree, record)
        t2 = time.perf_counter()
        decode_s += t1 - t0
        apply_s += t2 - t1
        events += len(records)
        print(f"applied {events:,} events ({blocks:,} blocks)", file=sys.stderr, flush=True)
    held = tree.block_count()

    latencies_us: list[float] = []
    hash_us: list[float] = []
    out = args.out.open("w") if args.out else None
    queries_s = 0.0
    try:
        for chunk in _chunks(args.queries):
            for line in chunk:
                q = decode.decode(line)
                tokens = q["token_ids"]
                t0 = time.perf_counter()
                local_hashes = local_block_hashes(tokens, args.block_size)
                t1 = time.perf_counter()
                scores = tree.find_matches(local_hashes)
                dt = time.perf_counter() - t1
                hash_us.append((t1 - t0) * 1e6)
                queries_s += dt
                latencies_us.append(dt * 1e6)
                if out is not None:
                    out.write(json.dumps({"query_id": q["query_id"], "scores": {str(w): n for w, n in scores.items()}}))
                    out.write("\n")
    finally:
        if out is not None:
            out.close()
    # What the index holds: resident memory given back when it is dropped (the peak would also
    # count the decoded events and whatever a rebuild held for a moment).
    peak_rss = rss_mb()
    holding_rss = rss_mb("VmRSS")
    del tree
    gc.collect()
    index_bytes = (holding_rss - rss_mb("VmRSS")) * 1024 * 1024
    summary = {
        "index": index,
        "events_applied": events,
        "blocks_applied": blocks,
        "blocks_held": held,
        "blocks_per_s": blocks / apply_s if apply_s else 0.0,
        "decode_blocks_per_s": blocks / decode_s if decode_s else 0.0,
        "queries": len(latencies_us),
        "queries_per_s": len(latencies_us) / queries_s if queries_s else 0.0,
        "query_p50_us": percentile(latencies_us, 50),
        "query_p99_us": percentile(latencies_us, 99),
        "hash_p50_us": percentile(hash_us, 50),
        "hash_p99_us": percentile(hash_us, 99),
        "peak_rss_mb": peak_rss,
        "bytes_per_held_block": index_bytes / held if held else 0.0,
    }
    print(json.dumps(summary))
