"""The HTTP edge alone (`make bench ARGS="--only http-edge"`): what one SSE event costs a server
with one event per stream every 20 ms, for uvicorn with each stream's task sending through ASGI
(the gateway before direct writes), uvicorn with kvmesh's direct writes (the gateway now), and
granian (a Rust HTTP server) through ASGI and through its RSGI interface. The servers run
http_edge_app.py; granian is installed into a side environment on first use (where it cannot
be, its rows say why).

Per server and stream count (64 and 512 streams x 200 events, three runs each, the servers taking
turns): the server's CPU µs per event (its process and its children), against uvicorn with
ASGI measured in the same run; the gaps the client sees between arrivals (p50, p99) once every
stream has its first event; and the lean load generator's own CPU per event, apart.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from testkit.proc_stat import group_cpu_seconds
from bench.common.report import bar_plot, median, median_range, percentile, save_json, table
from bench.common.side_venv import ROOT, Unavailable, side_venv, started
from bench.hot_path.lean_client import LeanStream, arrival_gaps, completion, lean_stream
from services.mesh.net import free_port

GRANIAN = "granian==2.8.9"
SERVERS = ("uvicorn-asgi", "uvicorn-direct", "granian-asgi", "granian-rsgi")
BASELINE = "uvicorn-asgi"
STREAMS = (64, 512)
EVENTS = 200
REPEATS = 3
READY_TIMEOUT_S = 30.0


@dataclass
class Figures:
    server_us: list[float] = field(default_factory=list)
    client_us: list[float] = field(default_factory=list)
    gap_ms: list[tuple[float, float]] = field(default_factory=list)  # p50, p99 per run
    note: str = ""


def _argv(server: str, port: int) -> list[str]:
    if server.startswith("uvicorn"):
        return [sys.executable, "-m", "bench.hot_path.http_edge_app", server, str(port)]
    granian = side_venv("granian-2.8.9", [[GRANIAN, "uvloop"]], "granian 2.8.9")
    return [str(granian), "-m", "granian", "--interface", server.removeprefix("granian-"), "--host", "127.0.0.1",
            "--port", str(port), "--workers", "1", "--loop", "uvloop", "--log-level", "warning", "--backlog", "4096",
            "--backpressure", "4096", f"bench.hot_path.http_edge_app:{server.removeprefix('granian-')}"]


@contextmanager
def _serving(server: str) -> Iterator[tuple[str, int]]:
    """The server's base URL and pid, once it answers."""
    port = free_port()
    env = dict(os.environ, KVMESH_EDGE_EVENTS=str(EVENTS), PYTHONPATH=str(ROOT))
    with started(_argv(server, port), env, server, cwd=ROOT) as proc:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                urllib.request.urlopen(f"{base}/", data=b"{}", timeout=30).read()
                break
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline or not proc.alive:
                    raise Unavailable(f"{server} did not answer within {READY_TIMEOUT_S:.0f}s") from None
                time.sleep(0.1)
        yield base, proc.pid


async def _load(base: str, streams: int) -> list[LeanStream]:
    return await asyncio.gather(*(lean_stream(base, completion("edge", "p", EVENTS), 120) for _ in range(streams)))


def _one_run(server: str, streams: int, figures: Figures) -> None:
    with _serving(server) as (base, pid):
        server0, client0 = group_cpu_seconds(pid), time.process_time()
        results = asyncio.run(_load(base, streams))
        server1, client1 = group_cpu_seconds(pid), time.process_time()
    events = sum(len(r.arrivals) for r in results)
    if events != streams * EVENTS:
        raise RuntimeError(f"{server}: {events} events arrived, {streams * EVENTS} were sent")
    steady = max(r.arrivals[0] for r in results)
    gaps = [gap for r in results for gap in arrival_gaps(r.arrivals, steady)]
    figures.server_us.append((server1 - server0) / events * 1e6)
    figures.client_us.append((client1 - client0) / events * 1e6)
    figures.gap_ms.append((percentile(gaps, 50), percentile(gaps, 99)))


def run() -> dict:
    figures = {(s, n): Figures() for s in SERVERS for n in STREAMS}
    for n in STREAMS:
        print(f"http edge: {n} streams x {EVENTS} events, {len(SERVERS)} servers taking turns, {REPEATS} runs ...",
              flush=True)
        for _ in range(REPEATS):
            for server in SERVERS:
                f = figures[(server, n)]
                if f.note:
                    continue
                try:
                    _one_run(server, n, f)
                except Unavailable as exc:
                    f.note = str(exc)
                    print(f"http edge: {server} skipped: {exc}", flush=True)
    rows = []
    for (server, n), f in figures.items():
        base = figures[(BASELINE, n)].server_us
        ratio = f"{median(f.server_us) / median(base):.2f}x" if f.server_us and base else "-"
        rows.append([server, n, median_range(f.server_us), ratio, median_range([g[0] for g in f.gap_ms]),
                     median_range([g[1] for g in f.gap_ms]), median_range(f.client_us), f.note[:80]])
    table(f"The HTTP edge alone: one SSE event per stream every 20 ms, {EVENTS} per stream (median [lowest-highest] "
          f"of {REPEATS} runs; ratio = CPU per event / {BASELINE}'s in the same run)",
          ["server", "streams", "server CPU us/event", "ratio", "gap p50 ms", "gap p99 ms", "client us/event", "note"],
          rows)
    bar_plot("http_edge", "Server CPU per SSE event (µs)", [f"{n} streams" for n in STREAMS],
             {s: [median(figures[(s, n)].server_us) for n in STREAMS] for s in SERVERS}, "µs per event")
    result = {f"{s} {n}": f.__dict__ for (s, n), f in figures.items()}
    save_json("http_edge", result)
    return result


if __name__ == "__main__":
    run()
