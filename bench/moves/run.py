"""make bench ARGS="--only moves": a rolling restart of the decode pool under long-context load,
with a drained worker's requests handed over with their KV (issue 47) against the two ways
kvmesh drained before and NVIDIA Dynamo 1.6.1's rolling restart, in the same run.

The setting: etcd, a kv-router (`--router-mode kv`), a processor, a frontend and 3 mocker decode
workers, each its own process, with `--kv-transfer nixl --no-remote-prefill`, 1024 KV bytes per
token (a 64k-token context is 64 MiB of the 256 MiB NIXL arena) and `--speedup 8` on the default
timing (h100-8b: a 64k-token prompt prefills in 21 s at speedup 1, here 2.6 s; a decode step
takes 1.5 ms). Eight clients, each an agent session, send streaming greedy completions back to
back: token-id contexts opening at 8k-32k tokens and growing a few hundred a turn up to 64k,
`ignore_eos`, 1536 tokens out (bench/moves/load.py).

The drain modes of the rolled workers:
- move: `--drain-mode move` (the default): running requests are handed over with their KV;
- recompute: `--drain-mode finish --drain-timeout 0`: running calls are cancelled at once and
  the processor migrates each one, the next worker computing prompt and output so far again;
- wait: `--drain-mode finish --drain-timeout 600`: the worker finishes its streams, then exits.

Per mode and repeat: a steady window (`STEADY_S`), then every decode worker is replaced one by one
(bench/moves/roll.py). One mesh serves every run: a roll's replacements carry the next run's
drain mode, so the workers the next run rolls are of its mode. Figures: bench/moves/figures.py;
tables, goals and plot: bench/moves/report.py; Dynamo: bench/moves/dynamo_roll.py.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from bench.common.side_venv import Unavailable
from bench.moves import dynamo_roll, report
from bench.moves.figures import Counters, RunRecord, figures, moved_streams
from bench.moves.load import REQUEST_TIMEOUT_S, Load
from bench.moves.mesh import DrainMode, MovesMesh
from bench.moves.roll import Roll, roll
from testkit import metrics
from testkit.proc import ROOT

MOVE = DrainMode("move", ("--drain-mode", "move"))
RECOMPUTE = DrainMode("recompute", ("--drain-mode", "finish", "--drain-timeout", "0"))
WAIT = DrainMode("wait", ("--drain-mode", "finish", "--drain-timeout", "600"))
MODES = (MOVE, RECOMPUTE, WAIT)
REPEATS = 2
WORKERS = 3
# The clients' first requests all prefill at once; the steady window starts after them.
WARMUP_S = 5.0
STEADY_S = 30.0
PROCESSOR_COUNTERS = {"handoffs": "kvmesh_processor_handoffs_total",
                      "migrations": "kvmesh_processor_migrations_total",
                      "recomputed": "kvmesh_processor_resumed_tokens_recomputed_total"}

# Rolls the serving system's decode pool once, returning the roll (the load runs meanwhile).
Roller = Callable[[], Awaitable[Roll]]


async def measure(base_url: str, mode: str, repeat: int, roller: Roller,
                  counters: Callable[[], Awaitable[dict[str, float]]] | None, request_ids: bool = False) -> RunRecord:
    """One run: the load, its steady window, the roll, then the load stopped and waited for
    (`counters`: the processor's, read before the roll and once the load has ended)."""
    load = Load(base_url, seed=repeat, request_ids=request_ids)
    clients = asyncio.create_task(load.run())
    try:
        await asyncio.sleep(WARMUP_S)
        steady = (time.perf_counter(), time.perf_counter() + STEADY_S)
        await asyncio.sleep(STEADY_S)
        before = await counters() if counters else {}
        rolled = await roller()
        record = RunRecord(mode, repeat, steady, rolled, Counters(), load.sent)
        await asyncio.sleep(max(0.0, record.roll_window[1] - time.perf_counter()))
    finally:
        load.stop.set()
        await asyncio.wait_for(clients, REQUEST_TIMEOUT_S + 10)
    if counters:
        after = await counters()
        record.counters = Counters(**{k: after[k] - before.get(k, 0.0) for k in PROCESSOR_COUNTERS})
    return record


def schedule() -> list[tuple[DrainMode, int]]:
    """Modes interleaved (move, recompute, wait, move, ...): a drift of the machine over the run
    spreads over all of them."""
    return [(mode, repeat) for repeat in range(REPEATS) for mode in MODES]


async def kvmesh_runs(run_dir: Path) -> list[RunRecord]:
    order = schedule()
    mesh = MovesMesh(run_dir, f"moves-{run_dir.name}")
    records = []
    try:
        await mesh.start([order[0][0]] * WORKERS)

        async def counters() -> dict[str, float]:
            samples = await mesh.processor_samples()
            return {k: metrics.total(samples, name) for k, name in PROCESSOR_COUNTERS.items()}

        for i, (mode, repeat) in enumerate(order):
            following = order[min(i + 1, len(order) - 1)][0]
            record = await measure(mesh.base_url, mode.name, repeat, functools.partial(roll, mesh, following), counters)
            record.roll.attribute(mesh.processor_lines())
            records.append(record)
            print(f"  {mode.name} (repeat {repeat + 1}): {report.one_line(figures(record))}", flush=True)
    finally:
        await mesh.stop()
        left = mesh.alive()
        if left:
            print(f"  WARNING: still running after the stop: {[p.name for p in left]}")
    return records


async def dynamo_runs(run_dir: Path) -> tuple[list[RunRecord], str]:
    """Dynamo's rolling restarts on one deployment (a roll leaves it with 3 fresh mockers), or
    why they did not run."""
    records = []
    try:
        async with dynamo_roll.serving(run_dir, WORKERS) as dynamo:
            for repeat in range(REPEATS):
                record = await measure(dynamo.base_url, dynamo_roll.NAME, repeat, dynamo.roll, None, request_ids=True)
                record.counters.migrations = dynamo.attribute(record.roll)
                records.append(record)
                print(f"  {dynamo_roll.NAME} (repeat {repeat + 1}): {report.one_line(figures(record))}", flush=True)
    except Unavailable as exc:
        return records, f"not run: {exc}"
    return records, ""


def run() -> None:
    started = time.monotonic()
    run_dir = ROOT / ".cache" / "runs" / time.strftime("moves-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"moves: rolling restarts of {WORKERS} decode workers under load; logs in {run_dir}", flush=True)
    records = asyncio.run(kvmesh_runs(run_dir))
    dynamo, why_not = asyncio.run(dynamo_runs(run_dir))
    runs: dict[str, list[dict[str, float]]] = {m.name: [] for m in MODES}
    runs[dynamo_roll.NAME] = []
    streams: dict[str, list[object]] = {name: [] for name in runs}
    for record in [*records, *dynamo]:
        runs[record.mode].append(figures(record))
        streams[record.mode].append([m.detail() for m in moved_streams(record)])
    report.report(runs, {dynamo_roll.NAME: why_not or dynamo_roll.NOTE}, time.monotonic() - started, streams)
