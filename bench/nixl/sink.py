"""The reading side of the NIXL benchmark: READs each size of a peer's buffer, repeatedly, and
times it. Used in-process by `run.py` and as its own process across hosts:

    python -m bench.nixl.sink           (the peer's offer, one JSON line, on standard input)

prints one JSON object, size -> seconds per READ.
"""

from __future__ import annotations

import base64
import json
import sys
import time
from collections.abc import Callable

import torch

MIN_SECONDS = 0.5
MAX_REPEATS = 2000
# A READ that has not finished in this long is a broken link, not a slow one.
READ_TIMEOUT_S = 30.0


def timed(run_once: Callable[[], object]) -> float:
    """Seconds per run: repeated until MIN_SECONDS have passed (after one warm-up run)."""
    run_once()
    runs, started = 0, time.perf_counter()
    while runs < MAX_REPEATS and (runs < 3 or time.perf_counter() - started < MIN_SECONDS):
        run_once()
        runs += 1
    return (time.perf_counter() - started) / runs


def read_seconds(offer: dict) -> dict[int, float]:
    """Seconds per READ of each size the peer offers (`offer`: its agent metadata and descriptors)."""
    from nixl._api import nixl_agent, nixl_agent_config

    sizes = sorted(int(n) for n in offer["descs"])
    agent = nixl_agent("bench-sink", nixl_agent_config(backends=["UCX"]))
    local = torch.zeros(max(sizes), dtype=torch.uint8)
    registration = agent.register_memory(local)
    try:
        agent.add_remote_agent(base64.b64decode(offer["metadata"]))
        seconds = {}
        for n in sizes:
            remote = agent.deserialize_descs(base64.b64decode(offer["descs"][str(n)]))
            local_descs = agent.get_xfer_descs(local[:n])

            def read_once(local_descs=local_descs, remote=remote, n=n) -> None:  # noqa: ANN001
                handle = agent.initialize_xfer("READ", local_descs, remote, "bench-source")
                state, deadline = agent.transfer(handle), time.monotonic() + READ_TIMEOUT_S
                while state != "DONE":
                    state = agent.check_xfer_state(handle)
                    if state == "ERR" or time.monotonic() > deadline:
                        raise RuntimeError(f"NIXL READ of {n} bytes {'failed' if state == 'ERR' else 'timed out'}")
                agent.release_xfer_handle(handle)

            seconds[n] = timed(read_once)
        return seconds
    finally:
        agent.deregister_memory(registration)


if __name__ == "__main__":
    print(json.dumps(read_seconds(json.loads(sys.stdin.readline()))), flush=True)
