"""Indexer throughput, query latency and memory, via the replay CLI on a synthetic trace.

The trace (bench/kv_trace.py): 16 workers, prefix-sharing conversations, > 1M stored blocks,
4k-token queries at block size 16. The baseline is the naive reference index the tests check
the real one against (a set of workers per node, every worker touched at every level), replayed
by the same CLI (`--index reference`) on the same trace in the same invocation, each in its own
process so peak RSS is its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.indexer.kv_trace import TraceSpec, write_trace
from bench.common.report import bar_plot, save_json, table

TRACE_DIR = Path(".cache/bench/trace-16w")
SPEC = TraceSpec()


def replay(index: str, events: Path, queries: Path) -> dict:
    argv = [sys.executable, "-m", "services.kv_router", "replay", "--index", index,
            "--events", str(events), "--queries", str(queries), "--block-size", str(SPEC.block_size)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run() -> dict:
    events, queries = TRACE_DIR / "events.jsonl", TRACE_DIR / "queries.jsonl"
    if not events.exists() or not queries.exists():
        print(f"indexer: writing the synthetic trace to {TRACE_DIR} (once) ...", flush=True)
        write_trace(TRACE_DIR, SPEC)
    print("indexer: replaying through the radix tree ...", flush=True)
    fast = replay("radix", events, queries)
    print("indexer: replaying through the naive baseline ...", flush=True)
    naive = replay("reference", events, queries)
    rows = []
    for name, r in (("radix tree (kvmesh)", fast), ("naive baseline", naive)):
        rows.append([name, r["blocks_applied"], r["blocks_held"], r["blocks_per_s"], r["query_p50_us"],
                     r["query_p99_us"], r["bytes_per_held_block"], r["peak_rss_mb"]])
    rows.append(["ratio kvmesh / baseline", "", "", fast["blocks_per_s"] / naive["blocks_per_s"],
                 fast["query_p50_us"] / naive["query_p50_us"], fast["query_p99_us"] / naive["query_p99_us"],
                 fast["bytes_per_held_block"] / naive["bytes_per_held_block"], fast["peak_rss_mb"] / naive["peak_rss_mb"]])
    table(f"Indexer replay: {SPEC.workers} workers, {fast['events_applied']:,} events, "
          f"{SPEC.max_blocks * SPEC.block_size}-token queries, block size {SPEC.block_size}",
          ["index", "blocks applied", "blocks held", "blocks/s", "query p50 us", "query p99 us", "bytes/held block",
           "peak RSS MB"], rows)
    print("goals: >= 1,000,000 blocks/s; query p99 <= 300 us; <= 100 bytes per held block "
          "(the resident memory the index gives back when dropped)", flush=True)
    bar_plot("indexer_query_latency", "4k-token query latency (us)", ["p50", "p99"],
             {"radix tree": [fast["query_p50_us"], fast["query_p99_us"]],
              "naive baseline": [naive["query_p50_us"], naive["query_p99_us"]]}, "microseconds")
    print("indexer: the conversation trace through 4 tiered mockers into one index ...", flush=True)
    out = subprocess.run([sys.executable, "-m", "bench.tiers.index"], capture_output=True, text=True, timeout=900, check=True)
    tiered = json.loads(out.stdout.strip().splitlines()[-1])
    table("Index memory, Mooncake conversation trace, device and host tiers held (tracemalloc)",
          ["requests", "device blocks held", "host blocks held", "bytes/held block"],
          [[tiered["requests"], tiered["device_blocks_held"], tiered["host_blocks_held"], tiered["bytes_per_held_block"]]])
    data = {"kvmesh": fast, "naive": naive, "conversation_tiers": tiered}
    save_json("indexer", data)
    return data
