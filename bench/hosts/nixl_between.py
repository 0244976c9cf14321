"""NIXL between two hosts of the bed against NIXL within one host, in the same run.

A peer process registers a buffer and the reading process READs it (bench/nixl/): both in one
host's namespace (with UCX's own choice of transport, then over TCP), then on two hosts (TCP
over veth and bridge, the path the mesh's KV transfers take in the bed), then on two hosts with
the reader's link held to 1 Gbit/s (tc tbf), as a slower network would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench.hosts.links import LinkShape, shape, unshape
from bench.hosts.netns import Bed, Host
from bench.nixl.run import label, offer_of, start_peer, stop_peer

SIZES = [1 << 20, 16 << 20, 64 << 20]
TCP = {"UCX_TLS": "tcp"}
SLOW_LINK = LinkShape(rate_mbit=1000)
TIMEOUT_S = 120.0


def _gbps(source: Host, reader: Host, env: dict[str, str]) -> dict[int, float]:
    peer = start_peer(source.argv(), SIZES, env)
    try:
        offer = json.dumps(offer_of(peer))
        done = subprocess.run(reader.argv(sys.executable, "-m", "bench.nixl.sink"), input=offer + "\n", text=True,
                              capture_output=True, timeout=TIMEOUT_S, env=dict(os.environ, **env))
        if done.returncode != 0:
            raise RuntimeError(f"NIXL reader failed: {done.stderr.strip().splitlines()[-1:]}")
        line = next(line for line in done.stdout.splitlines() if line.startswith("{"))
        return {int(n): int(n) / s / 1e9 for n, s in json.loads(line).items()}
    finally:
        stop_peer(peer)


def measure() -> tuple[list[str], list[list[object]]]:
    """The table's header and rows: GB/s per size for each path, and the ratio to one host over TCP."""
    with Bed(2) as bed:
        a, b = bed.hosts
        paths = [("one host, UCX's choice (shared memory)", a, a, {}), ("one host, TCP", a, a, TCP),
                 ("two hosts, TCP over veth + bridge", a, b, TCP)]
        results = [(name, _gbps(src, dst, env)) for name, src, dst, env in paths]
        shape(b, SLOW_LINK)
        try:
            results.append((f"two hosts, TCP, reader's link {SLOW_LINK}", _gbps(a, b, TCP)))
        finally:
            unshape(b)
    baseline = results[1][1]
    header = ["path", *(f"{label(n)} GB/s" for n in SIZES), f"vs one host TCP ({label(SIZES[-1])})"]
    rows = [[name, *(gbps[n] for n in SIZES), f"{gbps[SIZES[-1]] / baseline[SIZES[-1]]:.2f}x"] for name, gbps in results]
    return header, rows


if __name__ == "__main__":
    from bench.common.report import table

    table("NIXL READ throughput", *measure())
