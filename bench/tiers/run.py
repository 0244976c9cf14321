"""KV tiers under a real conversation trace: device cache only vs a host-memory tier, and how the router credits it.

Workload: the first 1,500 requests of Mooncake's public conversation trace (bench/traces/, loaded by
bench/tiers/mooncake_trace.py), prompts cut to MAX_INPUT_TOKENS, replayed in arrival order with the trace's clock
compressed TIME_SCALE times, each a streamed completion of min(its output length, OUTPUT_CAP) tokens. Mesh: 4 mocker
decode workers timed as an 8B model on a large GPU (sped up SPEEDUP times), each with 4,096 device blocks of 64
tokens (262,144 tokens) and 128 KiB of KV per token; the "host 8x" configurations give each worker 8x that in host
memory. Each configuration gets a fresh mesh. Reuse is the cached share of prompt tokens as the workers report it,
set against the ideal: what one infinite prefix cache would reuse on the same prompts (mooncake_trace.ideal_reuse).
"""

from __future__ import annotations

import asyncio
import http.client
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.request import urlopen

import aiohttp

from bench.common.client import ReuseTally
from bench.tiers.index import pooled_bound
from testkit import metrics
from testkit.mesh import LaunchedMesh, launched_mesh
from testkit.sse import stream_completion
from bench.tiers.mooncake_trace import TraceRequest, ideal_reuse, load
from bench.common.report import bar_plot, percentile, save_json, table
from services.tools.make_demo_model import DemoModelSpec, ensure_demo_model

SPEEDUP = 5.0
TIME_SCALE = 5.0  # the trace's 8.5 min of arrivals in about 100 s
MAX_INFLIGHT = 128
TIME_LIMIT_S = 240.0  # per configuration: arrivals after it are not sent, requests still open are cut
OUTPUT_CAP = 16
REQUESTS = 1500
MAX_INPUT_TOKENS = 131_072  # the model's context; the trace's longest prompt has 123,192
WORKERS = 4
NUM_GPU_BLOCKS = 4096
HOST_KV_BLOCKS = 8 * NUM_GPU_BLOCKS
# NVIDIA Dynamo's mocker default: 4,096 blocks hold 262,144 tokens, a few of the trace's conversations.
BLOCK_SIZE = 64
KV_BYTES_PER_TOKEN = 131_072
# The demo model's 4k context refuses most of the trace's prompts; the same model rebuilt with a 128k one serves them.
MODEL_DIR = Path(".cache/models/kvmesh-demo-128k")
MODEL = "kvmesh-demo-128k"

HOST = ("--host-kv-blocks", str(HOST_KV_BLOCKS))
SLOW_LINK = ("--host-kv-gbps", "4")
CONFIGS: dict[str, tuple[str, ...]] = {
    "device only, round-robin": ("--router-mode", "round-robin"),
    "device only, kv": ("--router-mode", "kv"),
    "host 8x, round-robin": ("--router-mode", "round-robin", *HOST),
    "host 8x, kv, tier ignored": ("--router-mode", "kv", *HOST, "--host-overlap-weight", "0"),
    "host 8x, kv, fixed 0.75": ("--router-mode", "kv", *HOST, "--host-overlap-weight", "0.75"),
    "host 8x, kv, cost-derived credit": ("--router-mode", "kv", *HOST),
    # A host link 12x slower (4 GB/s): loading 128 KiB per token back costs more than recomputing
    # all but the deepest tokens, so a fixed credit now sends requests where they wait longer.
    "host 8x at 4 GB/s, kv, fixed 0.75": ("--router-mode", "kv", *HOST, *SLOW_LINK, "--host-overlap-weight", "0.75"),
    "host 8x at 4 GB/s, kv, cost-derived credit": ("--router-mode", "kv", *HOST, *SLOW_LINK),
}
PLOT_LABELS = ("dev RR", "dev kv", "host RR", "host kv w=0", "host kv w=.75", "host kv cost", "slow w=.75",
               "slow cost")


@dataclass
class TierResult(ReuseTally):
    """`failures` counts requests refused, broken, or still open at the time limit."""

    name: str = ""
    not_sent: int = 0  # arrivals after the time limit
    host_hits: float = float("nan")  # prompt blocks loaded back from host memory, all workers
    seconds: float = 0.0

    @property
    def reuse(self) -> float:
        return self.hit_rate


async def one(session: aiohttp.ClientSession, request: TraceRequest, result: TierResult) -> None:
    result.add(await stream_completion(session, request.token_ids, min(request.output_tokens, OUTPUT_CAP), model=MODEL))


async def drive(base: str, name: str, requests: Sequence[TraceRequest]) -> TierResult:
    result = TierResult(name=name)
    limit = asyncio.Semaphore(MAX_INFLIGHT)
    connector = aiohttp.TCPConnector(limit=MAX_INFLIGHT)
    async with aiohttp.ClientSession(base, connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=TIME_LIMIT_S)) as session:
        async def limited(request: TraceRequest) -> None:
            async with limit:
                await one(session, request, result)

        started = time.monotonic()
        deadline = started + TIME_LIMIT_S
        tasks = []
        for request in requests:
            due = started + request.timestamp_s / TIME_SCALE
            if due > deadline:
                break
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            tasks.append(asyncio.create_task(limited(request)))
        result.not_sent = len(requests) - len(tasks)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            result.failures += len(pending)
        result.seconds = time.monotonic() - started
    return result


def host_hits(mesh: LaunchedMesh) -> float:
    """kvmesh_worker_host_hits_total summed over the mesh's decode workers, read from the /metrics
    of each port they listen on (the launcher prints their pids, not their ports); NaN if none."""
    total, found = 0.0, False
    for address in _listening(mesh.pids("decode-worker")):
        try:
            with urlopen(f"http://{address}/metrics", timeout=1.0) as response:
                samples = metrics.parse(response.read().decode())
        except (OSError, http.client.HTTPException, ValueError):
            continue  # a gRPC port, or one that serves no metrics
        hits = metrics.matching(samples, "kvmesh_worker_host_hits_total")
        total += sum(s.value for s in hits)
        found = found or bool(hits)
    return total if found else float("nan")


def _listening(pids: Sequence[int]) -> list[str]:
    """The TCP addresses these processes listen on, from /proc."""
    sockets: set[str] = set()
    for pid in pids:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        sockets.update(link[8:-1] for link in links if link.startswith("socket:["))
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return sorted({_address(r[1]) for r in rows if r[3] == "0A" and r[9] in sockets})


def _address(hex_address: str) -> str:
    """'0100007F:1F90' (/proc/net/tcp) -> '127.0.0.1:8080'; a wildcard address becomes loopback."""
    ip, port = hex_address.split(":")
    octets = bytes.fromhex(ip)[::-1]
    return f"{'.'.join(map(str, octets)) if any(octets) else '127.0.0.1'}:{int(port, 16)}"


def run() -> dict:
    model = ensure_demo_model(MODEL_DIR, DemoModelSpec(max_context=MAX_INPUT_TOKENS))
    requests = load(limit=REQUESTS, max_input_tokens=MAX_INPUT_TOKENS)
    ideal = ideal_reuse(requests, BLOCK_SIZE)
    print(f"tiers: {len(requests)} requests, {sum(len(r.token_ids) for r in requests):,} prompt tokens, "
          f"ideal reuse {ideal:.1%}", flush=True)
    # What capacity allows: one LRU cache with all four workers' blocks, routed without load.
    bound = pooled_bound(requests, WORKERS, NUM_GPU_BLOCKS, HOST_KV_BLOCKS, BLOCK_SIZE)
    print(f"tiers: one pooled LRU cache of all workers' device and host blocks reuses {bound:.1%} "
          f"({bound / ideal:.2f} of ideal): no routing of these workers' caches does much better", flush=True)
    results = []
    for name, extra in CONFIGS.items():
        print(f"tiers: {name} ...", flush=True)
        with launched_mesh("--engine", "mocker", "--timing", "large-gpu-8b", "--speedup", str(SPEEDUP),
                      "--decode-workers", str(WORKERS), "--prefill-workers", "0", "--num-gpu-blocks",
                      str(NUM_GPU_BLOCKS), "--block-size", str(BLOCK_SIZE), "--kv-bytes-per-token",
                      str(KV_BYTES_PER_TOKEN), "--model", str(model), "--served-model-name", MODEL, *extra) as mesh:
            result = asyncio.run(drive(mesh.base, name, requests))
            result.host_hits = host_hits(mesh)
        results.append(result)
    rows = [[r.name, len(r.ttft_ms), r.failures, r.not_sent, f"{r.reuse:.1%}", f"{r.reuse / ideal:.2f}" if ideal else "-",
             percentile(r.ttft_ms, 50), percentile(r.ttft_ms, 99), r.host_hits] for r in results]
    table(f"KV tiers on {len(requests)} Mooncake conversation requests (prompts <= {MAX_INPUT_TOKENS} tokens, "
          f"{TIME_SCALE:g}x faster arrivals), {WORKERS} mocker workers x {NUM_GPU_BLOCKS} device blocks; "
          f"ideal reuse {ideal:.1%}",
          ["configuration", "done", "failed", "not sent", "reuse", "reuse / ideal", "TTFT p50 ms", "TTFT p99 ms",
           "host hits (blocks)"], rows)
    bar_plot("tiers_reuse", "Prefix reuse / ideal", list(PLOT_LABELS),
             {"reuse / ideal": [r.reuse / ideal if ideal else 0.0 for r in results]}, "share of ideal")
    bar_plot("tiers_ttft", "TTFT p50 (ms)", list(PLOT_LABELS),
             {"p50": [percentile(r.ttft_ms, 50) for r in results]}, "ms")
    data = {"ideal_reuse": ideal, "pooled_lru_bound": bound, "requests": len(requests), "max_input_tokens": MAX_INPUT_TOKENS,
            "time_scale": TIME_SCALE, "speedup": SPEEDUP, "output_cap": OUTPUT_CAP,
            "configs": {r.name: {"flags": list(CONFIGS[r.name]), "done": len(r.ttft_ms), "failures": r.failures,
                                 "not_sent": r.not_sent, "prompt_tokens": r.prompt_tokens,
                                 "cached_tokens": r.cached_tokens, "reuse": r.reuse,
                                 "reuse_over_ideal": r.reuse / ideal if ideal else None,
                                 "ttft_p50_ms": percentile(r.ttft_ms, 50), "ttft_p99_ms": percentile(r.ttft_ms, 99),
                                 "host_hit_blocks": r.host_hits, "seconds": r.seconds} for r in results}}
    save_json("tiers", data)
    return data
