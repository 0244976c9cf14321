"""make chaos ARGS="--hosts": the mesh across network namespaces, under partitions and loss.

    make chaos ARGS="--hosts [--layout P,R,F,D] [--cut S] [--rate R] [--loss PCT] [--link HOST=SHAPE]"
    (or python -m bench.hosts ...)

A bed of hosts (bench/hosts/netns.py): 3 etcd members, then one host per service instance of the
layout (by default 1 frontend, 2 processors, 2 routers, 2 prefill and 4 mocker decode workers:
14 hosts). First NIXL's throughput between two hosts is measured against one host. Then the
mesh serves a steady load of requests, each with a prompt of its own, a third of them long
enough to be prefilled on the prefill pool, while one fault at a time is applied and healed
(bench/hosts/faults.py):

- a decode worker cut from every other host mid-stream (its requests move across hosts);
- a decode worker cut from the etcd hosts only (its lease lapses while it still serves);
- a processor cut from one of the two routers;
- the etcd leader cut from the other two members (a minority partition);
- a prefill worker cut from the decode workers while KV transfers are in flight;
- packet loss on one decode worker's link (default 2% for 20 s).

After each heal, every answer is checked by asking its prompt again (bench/hosts/load.py). For a
fault that took instances out of etcd, time-to-recover is how long until they are registered
again (for the etcd leader, until it also answers a quorum read). Goals: 0 corrupted, >= 99% of
requests answered, every instance registered again within the lease TTL + 2 s of its heal, and
what each fault asks of the mesh (the worker etcd dropped gets no new work and keeps its process;
the cut transfer is given up for a local prefill). Exits 0 when they hold, 1 when not, 2 where
namespaces cannot be made (with the reason).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import httpx

from bench.common.report import save_json, table
from bench.hosts import nixl_between
from bench.hosts.faults import faults
from bench.hosts.links import LinkShape, delay_unavailable, loss_unavailable, shape
from bench.hosts.load import Row, Tally, under_load
from bench.chaos.mesh import MeshLayout
from bench.hosts.mesh import HostsMesh, hosts_for
from bench.hosts.netns import Bed, unavailable
from services.mesh.etcd_lease import LeaseConfig

RECOVER_GOAL_S = LeaseConfig().ttl_s + 2.0
ANSWERED_GOAL = 0.99


async def run(layout: MeshLayout, cut_s: float, rate: float, loss_pct: float, loss_s: float,
              links: dict[int, LinkShape], only: str = "", engine: str = "mocker") -> list[Row]:
    # SIGTERM stops the run as Ctrl-C does: the faults healed, the mesh stopped, the bed removed.
    main_task = asyncio.current_task()
    assert main_task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    run_dir = Path(tempfile.mkdtemp(prefix="kvmesh-hosts-"))
    print(f"hosts: {hosts_for(layout)} namespaces ({layout}), logs in {run_dir}", flush=True)
    long_share = 1 / 3 if layout.prefill_workers else 0.0
    with Bed(hosts_for(layout)) as bed:
        for index, link in links.items():
            shape(bed.hosts[index - 1], link)
        mesh = HostsMesh(bed, run_dir, layout, engine=engine)
        try:
            await mesh.start()
            rows = []
            chosen, skipped = faults(mesh, loss_pct, loss_s)
            for why in skipped:
                print(f"hosts: skipped: {why}", flush=True)
            async with httpx.AsyncClient(timeout=120) as client:
                rows.append(await under_load(mesh, client, None, cut_s, rate, long_share))
                for fault in (f for f in chosen if only in f.name):
                    if main_task.cancelling():
                        # A stop whose cancellation something below swallowed (Python 3.11's
                        # wait_for can, when its call completes at the same moment) still stops.
                        raise asyncio.CancelledError
                    rows.append(await under_load(mesh, client, fault, fault.hold_s or cut_s, rate, long_share))
            missing = await mesh.missing()
            print(f"hosts: after every fault: {'full strength' if not missing else 'MISSING ' + ', '.join(missing)}")
            if missing:
                rows.append(Row("after every fault: full strength", Tally(), None, "", "missing: " + ", ".join(missing)))
            return rows
        finally:
            await mesh.stop()


def _layout(text: str) -> MeshLayout:
    """P,R,F,D: processors, routers, prefill and decode workers (one frontend)."""
    try:
        p, r, f, d = (int(n) for n in text.split(","))
        return MeshLayout(processors=p, routers=r, prefill_workers=f, decode_workers=d)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"a layout is P,R,F,D (processors, routers, prefill, decode): {exc}") from exc


def _link(text: str) -> tuple[int, LinkShape]:
    host, _, spec = text.partition("=")
    try:
        return int(host), LinkShape.parse(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--link HOST=loss=PCT,rate=MBIT,delay=MS,jitter=MS: {exc}") from exc


def report(rows: list[Row], args: argparse.Namespace) -> None:
    table(f"Faults across hosts ({args.layout}; partitions healed after {args.cut:.0f}s)",
          ["fault", "requests", "exact", "corrupted", "failed", "p50 (s)", "p99 (s)", "registered again (s)",
           "what it showed"],
          [[r.fault, r.tally.sent, r.tally.exact, r.tally.corrupted, len(r.tally.failures), r.tally.latency(0.5),
            r.tally.latency(0.99), "-" if r.recover_s is None else f"{r.recover_s:.1f}", r.note] for r in rows])
    for r in rows:
        for failure in r.tally.failures[:3]:
            print(f"  {r.fault}: {failure}")
        if r.tally.unverified:
            print(f"  {r.fault}: {r.tally.unverified} answers could not be asked again after the heal")
    save_json("hosts", [{"fault": r.fault, "requests": r.tally.sent, "exact": r.tally.exact,
                         "corrupted": r.tally.corrupted, "unverified": r.tally.unverified, "failed": r.tally.failures,
                         "registered_again_s": r.recover_s, "p50_s": r.tally.latency(0.5),
                         "p99_s": r.tally.latency(0.99), "note": r.note, "problem": r.problem} for r in rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make chaos ARGS=\"--hosts ...\"", description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", type=_layout, default=MeshLayout(),
                   help="processors,routers,prefill,decode (default 2,2,2,4; one frontend)")
    p.add_argument("--cut", type=float, default=12.0, help="seconds each partition lasts (above the 10 s lease TTL)")
    p.add_argument("--rate", type=float, default=4.0, help="requests per second of steady load")
    p.add_argument("--loss", type=float, default=2.0, help="packet loss of the lossy-link fault, %%")
    p.add_argument("--loss-for", type=float, default=20.0, help="seconds the lossy-link fault lasts")
    p.add_argument("--link", type=_link, action="append", default=[],
                   help="HOST=loss=PCT,rate=MBIT,delay=MS,jitter=MS: shape host HOST's link for the whole run")
    p.add_argument("--engine", choices=("mocker", "vllm"), default="mocker",
                   help="the workers' engine (vllm: the demo model on CPU; use a small layout and rate)")
    p.add_argument("--only", default="", help="run only the faults whose name contains this text")
    p.add_argument("--no-nixl", action="store_true", help="skip the NIXL throughput measurement")
    args = p.parse_args(argv)
    why = unavailable()
    if why is not None:
        print(f"hosts: cannot make hosts here: {why}", file=sys.stderr)
        return 2
    links = dict(args.link)
    if bad := [h for h in links if not 1 <= h <= hosts_for(args.layout)]:
        p.error(f"--link: the bed has hosts 1 to {hosts_for(args.layout)}, not {bad}")
    if any(link.delay_ms for link in links.values()) and (no_delay := delay_unavailable()) is not None:
        print(f"hosts: delay and jitter skipped: {no_delay}", flush=True)
        links = {host: replace(link, delay_ms=0.0, jitter_ms=0.0) for host, link in links.items()}
    if any(link.loss_pct for link in links.values()) and (no_loss := loss_unavailable()) is not None:
        print(f"hosts: cannot shape links with loss: {no_loss}", file=sys.stderr)
        return 2
    if not args.no_nixl:
        print("hosts: NIXL between two hosts vs one host ...", flush=True)
        table("NIXL READ throughput, one host vs two (UCX, DRAM to DRAM)", *nixl_between.measure())
    try:
        rows = asyncio.run(run(args.layout, args.cut, args.rate, args.loss, args.loss_for, links, args.only,
                               args.engine))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("hosts: stopped; the mesh and the bed are gone", file=sys.stderr)
        return 130
    report(rows, args)
    sent = sum(r.tally.sent for r in rows)
    answered = sum(r.tally.answered for r in rows)
    problems = [f"{r.fault}: {r.problem}" for r in rows if r.problem]
    late = [r.fault for r in rows if r.recover_s is not None and r.recover_s > RECOVER_GOAL_S]
    ok = not problems and not late and not any(r.tally.corrupted for r in rows) and answered >= ANSWERED_GOAL * sent
    for line in problems + [f"{fault}: not registered again within {RECOVER_GOAL_S:.0f}s" for fault in late]:
        print(f"  NOT MET: {line}")
    print(f"answered {answered}/{sent} ({answered / max(1, sent):.1%}); goal: 0 corrupted, >= {ANSWERED_GOAL:.0%} "
          f"answered, every instance registered again within {RECOVER_GOAL_S:.0f}s of its heal, and what each fault "
          f"asks of the mesh: {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
