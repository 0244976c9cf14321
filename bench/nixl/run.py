"""NIXL transfer throughput between two processes (UCX, DRAM to DRAM) against a plain memory copy.

The peer process registers one buffer and publishes descriptors for each size; this process
READs each size repeatedly into its own registered buffer. The baseline copies the same number
of bytes between two buffers of this process with a single-threaded memcpy (numpy.copyto), in
the same run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout

import numpy as np

from bench.common.report import bar_plot, save_json, table
from bench.nixl.sink import read_seconds, timed

SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
OFFER_TIMEOUT_S = 60.0


def label(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def memcpy_seconds(n: int, src: np.ndarray, dst: np.ndarray) -> float:
    return timed(lambda: np.copyto(dst[:n], src[:n]))


def offer_of(peer: subprocess.Popen[str], timeout_s: float = OFFER_TIMEOUT_S) -> dict:
    """The peer's offer: NIXL logs to stdout too, so it is the line that is JSON."""
    assert peer.stdout is not None
    stdout = peer.stdout
    with ThreadPoolExecutor(1) as reader:
        found = reader.submit(lambda: next((line for line in stdout if line.startswith("{")), ""))
        try:
            line = found.result(timeout_s)
        except FuturesTimeout:
            peer.kill()  # unblocks the reader
            raise RuntimeError(f"the NIXL peer made no offer within {timeout_s:.0f}s") from None
    if not line:
        raise RuntimeError(f"the NIXL peer exited ({peer.wait()}) without an offer")
    return json.loads(line)


def stop_peer(peer: subprocess.Popen[str]) -> None:
    """Closes the peer's standard input (it exits then); kills it if it does not."""
    if peer.stdin is not None:
        peer.stdin.close()
    try:
        peer.wait(30)
    except subprocess.TimeoutExpired:
        peer.kill()
        peer.wait(10)


def start_peer(prefix: list[str] | None = None, sizes: list[int] = SIZES,
               env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """The serving process (`prefix`: what to run it under, e.g. `ip netns exec`); it exits when
    its standard input closes."""
    return subprocess.Popen([*(prefix or []), sys.executable, "-m", "bench.nixl.peer", *map(str, sizes)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=None if env is None else dict(os.environ, **env))


def run() -> dict:
    peer = start_peer()
    try:
        seconds = read_seconds(offer_of(peer))
        src = np.random.default_rng(0).integers(0, 256, max(SIZES), dtype=np.uint8)
        dst = np.zeros(max(SIZES), dtype=np.uint8)
        rows, results = [], []
        for n in SIZES:
            nixl_s = seconds[n]
            copy_s = memcpy_seconds(n, src, dst)
            nixl_gbps, copy_gbps = n / nixl_s / 1e9, n / copy_s / 1e9
            results.append({"bytes": n, "nixl_GBps": nixl_gbps, "memcpy_GBps": copy_gbps})
            rows.append([label(n), nixl_gbps, copy_gbps, f"{nixl_gbps / copy_gbps:.0%}", nixl_s * 1e6])
    finally:
        stop_peer(peer)
    table("NIXL READ between two processes (UCX, DRAM) vs single-threaded memcpy, same run",
          ["size", "NIXL GB/s", "memcpy GB/s", "NIXL / memcpy", "NIXL us per transfer"], rows)
    print("goal: NIXL >= 80% of memcpy from 4 MiB up", flush=True)
    bar_plot("nixl_throughput", "Transfer throughput (GB/s)", [label(n) for n in SIZES],
             {"NIXL (2 processes)": [r["nixl_GBps"] for r in results], "memcpy": [r["memcpy_GBps"] for r in results]},
             "GB/s")
    save_json("nixl_transfer", results)
    return {"sizes": results}
