"""NIXL transfer throughput between two processes (UCX, DRAM to DRAM) against a plain memory copy.

The peer process registers one buffer and publishes descriptors for each size; this process
READs each size repeatedly into its own registered buffer. The baseline copies the same number
of bytes between two buffers of this process with a single-threaded memcpy (numpy.copyto), in
the same run.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time

import numpy as np
import torch

from bench.common.report import bar_plot, save_json, table

SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
MIN_SECONDS = 0.5
MAX_REPEATS = 2000


def label(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _timed(run_once) -> float:  # noqa: ANN001
    """Seconds per run: repeated until MIN_SECONDS have passed (after one warm-up run)."""
    run_once()
    runs, started = 0, time.perf_counter()
    while runs < MAX_REPEATS and (runs < 3 or time.perf_counter() - started < MIN_SECONDS):
        run_once()
        runs += 1
    return (time.perf_counter() - started) / runs


def memcpy_seconds(n: int, src: np.ndarray, dst: np.ndarray) -> float:
    return _timed(lambda: np.copyto(dst[:n], src[:n]))


def run() -> dict:
    from nixl._api import nixl_agent, nixl_agent_config

    peer = subprocess.Popen([sys.executable, "-m", "bench.nixl.peer", *map(str, SIZES)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert peer.stdout is not None
        # NIXL logs to stdout too: the offer is the line that is JSON.
        offer = next(json.loads(line) for line in peer.stdout if line.startswith("{"))
        agent = nixl_agent("bench-sink", nixl_agent_config(backends=["UCX"]))
        local = torch.zeros(max(SIZES), dtype=torch.uint8)
        registration = agent.register_memory(local)
        agent.add_remote_agent(base64.b64decode(offer["metadata"]))
        src = np.random.default_rng(0).integers(0, 256, max(SIZES), dtype=np.uint8)
        dst = np.zeros(max(SIZES), dtype=np.uint8)
        rows, results = [], []
        for n in SIZES:
            remote = agent.deserialize_descs(base64.b64decode(offer["descs"][str(n)]))
            local_descs = agent.get_xfer_descs(local[:n])

            def read_once(local_descs=local_descs, remote=remote) -> None:  # noqa: ANN001
                handle = agent.initialize_xfer("READ", local_descs, remote, "bench-source")
                state = agent.transfer(handle)
                while state != "DONE":
                    state = agent.check_xfer_state(handle)
                    if state == "ERR":
                        raise RuntimeError("NIXL transfer failed")
                agent.release_xfer_handle(handle)

            nixl_s = _timed(read_once)
            copy_s = memcpy_seconds(n, src, dst)
            nixl_gbps, copy_gbps = n / nixl_s / 1e9, n / copy_s / 1e9
            results.append({"bytes": n, "nixl_GBps": nixl_gbps, "memcpy_GBps": copy_gbps})
            rows.append([label(n), nixl_gbps, copy_gbps, f"{nixl_gbps / copy_gbps:.0%}", nixl_s * 1e6])
        agent.deregister_memory(registration)
    finally:
        if peer.stdin is not None:
            peer.stdin.close()
        peer.wait(30)
    table("NIXL READ between two processes (UCX, DRAM) vs single-threaded memcpy, same run",
          ["size", "NIXL GB/s", "memcpy GB/s", "NIXL / memcpy", "NIXL us per transfer"], rows)
    print("goal: NIXL >= 80% of memcpy from 4 MiB up", flush=True)
    bar_plot("nixl_throughput", "Transfer throughput (GB/s)", [label(n) for n in SIZES],
             {"NIXL (2 processes)": [r["nixl_GBps"] for r in results], "memcpy": [r["memcpy_GBps"] for r in results]},
             "GB/s")
    save_json("nixl_transfer", results)
    return {"sizes": results}
