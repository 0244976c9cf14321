"""make chaos: streaming load on a disaggregated mocker mesh while its processes are killed.

    python -m bench.chaos [--quick] [--duration S] [--rate R] [--seed N] [--etcd-outage S]
    python -m bench.chaos --hosts [--layout P,R,F,D] [--cut S] [--rate R] [--loss PCT] [--link H=SHAPE] [--only TEXT]
        (bench/hosts/: the mesh across network namespaces, under partitions and loss)

What it does, and why:
1. Starts etcd and, each as its own process in one fresh namespace, 2 kv-routers, 2 processors,
   1 frontend, 2 prefill workers and 4 decode workers on the mocker, disaggregated (decode
   workers send prompts of more than 256 uncached tokens to the prefill workers over NIXL).
   A request streams for about 3 s (240 tokens at the mocker's 12 ms decode step; the quick
   run's 48 tokens, about half a second).
2. Streams a seeded mix of short text prompts and long token-id prompts at `--rate` requests/s
   from a bounded pool of clients, all `ignore_eos` with a fixed `max_tokens` and greedy or
   seeded sampling, so every answer is a known pure function of its request.
3. Meanwhile carries out a seeded fault schedule (faults.py): SIGKILL a decode
   worker, a prefill worker, a processor and a router, each replaced at once; roll (SIGTERM) a
   decode worker, which hands its streams over to the others with their KV; stop etcd for
   `--etcd-outage` seconds and restart it on the same ports and data dir. The load runs until
   the last fault has played out.
4. Afterwards re-sends each distinct request once to the settled mesh and compares every
   completed stream with it; sums the processors' and decode workers' counters (scraped all
   along, as restarts reset them).
5. Prints the tables, stops every process (SIGTERM, then SIGKILL) and looks for anything of the
   run left alive. Exit status 0 only with no failed, corrupted or unverifiable request, no
   orphan, no unexpected process exit and every fault carried out; 1 otherwise, with the reasons.
The run directory (every process's log) is printed, and kept when the run fails or `--keep`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from bench.chaos.faults import Fault, FaultRunner, plan
from bench.chaos.load import Load, RequestSpec, Verdict, catalogue, drive, stream_one, verify
from bench.chaos.mesh import ChaosMesh, MeshLayout
from bench.chaos.metrics import MetricsWatcher
from bench.chaos.procs import Leftover, leftovers
from bench.chaos.report import print_report, result_line, summarize
from testkit.proc import ProcFailed

# Short form for the test suite: ~40 s of load, a 12 s outage, a small catalogue to verify.
# The full run's answers outlast a drain's propagation delay (1 s), so the rolled decode worker
# has streams left to hand over; the quick run's are short (the suite's time).
QUICK = {"duration": 40.0, "rate": 2.0, "etcd_outage": 12.0, "shorts": 4, "longs": 8, "max_tokens": 48}
DEFAULT = {"duration": 150.0, "rate": 2.0, "etcd_outage": 30.0, "shorts": 10, "longs": 30, "max_tokens": 240}
TAIL_S = 5.0  # load kept up after the last fault has played out
FAULTS_GRACE_S = 150.0  # the most the faults may overrun the planned duration


@dataclass(frozen=True)
class Options:
    duration: float
    rate: float
    seed: int
    etcd_outage: float
    shorts: int
    longs: int
    clients: int
    max_tokens: int
    speedup: float
    keep: bool


def parse_args(argv: list[str] | None = None) -> Options:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the short form (the test suite runs it)")
    p.add_argument("--duration", type=float, help="seconds of load (default 150; quick 40)")
    p.add_argument("--rate", type=float, help="requests per second (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seeds the requests, the fault order, times and victims")
    p.add_argument("--etcd-outage", type=float, help="seconds etcd stays down (default 30; quick 12)")
    p.add_argument("--clients", type=int, default=16, help="most streams in flight at once")
    p.add_argument("--max-tokens", type=int, help="tokens per answer (default 240; quick 48)")
    p.add_argument("--speedup", type=float, default=1.0, help="mocker speedup (1: 12 ms per decode step)")
    p.add_argument("--keep", action="store_true", help="keep the run directory even when the run passes")
    a = p.parse_args(argv)
    base = QUICK if a.quick else DEFAULT
    opts = Options(duration=a.duration or base["duration"], rate=a.rate or base["rate"], seed=a.seed,
                   etcd_outage=base["etcd_outage"] if a.etcd_outage is None else a.etcd_outage,
                   shorts=int(base["shorts"]), longs=int(base["longs"]), clients=a.clients,
                   max_tokens=a.max_tokens or int(base["max_tokens"]), speedup=a.speedup, keep=a.keep)
    if opts.duration <= 0 or opts.rate <= 0 or opts.etcd_outage < 0 or opts.clients < 1 or opts.max_tokens < 1:
        p.error("--duration, --rate, --clients and --max-tokens must be > 0, --etcd-outage >= 0")
    return opts


async def warm_up(mesh: ChaosMesh, specs: list[RequestSpec], max_tokens: int) -> None:
    """One short and one long request must complete before the clock starts (not counted)."""
    import aiohttp

    deadline = time.monotonic() + 60
    wanted = [next(s for s in specs if not s.long), next(s for s in specs if s.long)]
    async with aiohttp.ClientSession(mesh.base_url, timeout=aiohttp.ClientTimeout(total=30)) as session:
        for spec in wanted:
            while not (o := await stream_one(session, spec, max_tokens, time.monotonic())).completed:
                if time.monotonic() > deadline:
                    raise ProcFailed(f"the mesh does not answer: {o.error}")
                await asyncio.sleep(1)


async def chaos(opts: Options, mesh: ChaosMesh) -> tuple[Load, Verdict, MetricsWatcher, list[Fault]]:
    """Load, faults and scraping together; then the settle wait and the verification."""
    specs = catalogue(opts.seed, opts.shorts, opts.longs)
    await mesh.start()
    await warm_up(mesh, specs, opts.max_tokens)
    t0 = time.monotonic()
    load, watcher, faults = Load(), MetricsWatcher(mesh), plan(opts.seed, opts.duration, opts.etcd_outage)
    print(f"load: {opts.rate:g} req/s for {opts.duration:g}s (+ until the faults are done); faults: "
          + ", ".join(f"{f.kind}@{f.planned_s}s" for f in faults), flush=True)
    stop_load, stop_scraping = asyncio.Event(), asyncio.Event()
    max_requests = int(opts.rate * (opts.duration + FAULTS_GRACE_S)) + 1
    tasks = [asyncio.create_task(drive(mesh.base_url, specs, opts.seed, opts.rate, stop_load, max_requests,
                                       opts.clients, opts.max_tokens, t0, load)),
             asyncio.create_task(watcher.run(stop_scraping))]
    try:
        runner = FaultRunner(mesh, opts.seed, opts.etcd_outage, load.busy, t0)
        try:
            await asyncio.wait_for(runner.run(faults), opts.duration + FAULTS_GRACE_S)
        except TimeoutError:
            print("the fault schedule overran its time; stopping it", flush=True)
        await asyncio.sleep(max(TAIL_S, opts.duration - (time.monotonic() - t0)))
        stop_load.set()
        await tasks[0]
        print(f"load done at {time.monotonic() - t0:.0f}s: {load.sent} sent; waiting for the mesh to settle",
              flush=True)
        if not await mesh.settled(60):
            print(f"the mesh did not settle within 60s: etcd lists {await mesh.registered_counts()}", flush=True)
        stop_scraping.set()
        await tasks[1]
        verdict = await verify(mesh.base_url, specs, load.outcomes, opts.max_tokens, t0)
    finally:
        for task in tasks:
            task.cancel()
    return load, verdict, watcher, faults


def unexpected_exits(mesh: ChaosMesh) -> list[str]:
    """Processes of the run that exited while nobody had signalled them."""
    return [f"{c.name} pid {c.pid} exited unasked with {c.popen.returncode}: {c.tail(3)}"
            for c in [*mesh.children, *mesh.etcd.started] if not c.alive and not c.signalled]


async def main_async(opts: Options) -> int:
    namespace = f"chaos-{uuid.uuid4().hex[:8]}"
    run_dir = Path(tempfile.mkdtemp(prefix=f"kvmesh-{namespace}-"))
    print(f"chaos run {namespace}: logs in {run_dir}", flush=True)
    mesh = ChaosMesh(run_dir, namespace, MeshLayout(speedup=opts.speedup))
    results, error, unexpected = None, "", []
    try:
        results = await chaos(opts, mesh)
    except (ProcFailed, asyncio.CancelledError) as exc:
        error = "interrupted" if isinstance(exc, asyncio.CancelledError) else str(exc)
    finally:
        unexpected = unexpected_exits(mesh)
        codes = await mesh.stop()
    orphans = await _orphans(namespace, mesh)
    stop_failures = [f"{name} exited {code} on the final SIGTERM (want 0)" for name, code in codes.items() if code != 0]
    if results is None:
        print(f"chaos: FAIL: {error}\nunexpected exits: {unexpected}\norphans: {orphans}\nlogs: {run_dir}", flush=True)
        return 1
    load, verdict, watcher, faults = results
    summary = summarize(load, verdict, watcher, faults, unexpected + stop_failures, orphans)
    names = {i: c.name for c in mesh.children for i in c.ids}
    print_report(summary, load, verdict, watcher, faults, names, unexpected + stop_failures, orphans)
    print(result_line(summary, str(run_dir)), flush=True)
    if summary.passed and not opts.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
        print("chaos: PASS", flush=True)
        return 0
    print(("chaos: PASS" if summary.passed else "chaos: FAIL: " + "; ".join(summary.reasons))
          + f" (logs kept in {run_dir})", flush=True)
    return 0 if summary.passed else 1


async def _orphans(namespace: str, mesh: ChaosMesh) -> list[Leftover]:
    """What is left of the run after the stop; each is reported, then SIGKILLed by pid."""
    await asyncio.sleep(1)
    found = leftovers(namespace, mesh.all_pids())
    for left in found:
        try:
            os.kill(left.pid, signal.SIGKILL)
        except OSError:
            pass
    return found


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "--hosts" in args:  # the mesh across network namespaces (bench/hosts/)
        from bench.hosts.__main__ import main as hosts

        return hosts([a for a in args if a != "--hosts"])
    opts = parse_args(args)

    async def guarded() -> int:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()

        def interrupt() -> None:
            # Once: a second signal must not cut short the clean-up the first one started.
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, lambda: None)
            task.cancel()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, interrupt)
        return await main_async(opts)

    try:
        return asyncio.run(guarded())
    except asyncio.CancelledError:
        print("chaos: FAIL: interrupted", flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
