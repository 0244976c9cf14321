"""make chaos ARGS="--hosts": the mesh across network namespaces, under partitions.

    make chaos ARGS="--hosts [--workers N] [--cut S] [--rate R]"    (or python -m bench.hosts ...)

A bed of 4 + N hosts (bench/hosts/netns.py: 3 etcd members, the router, processor and frontend,
N mocker decode workers) serves a steady load of requests drawn from a catalogue whose exact
answers were taken on the healthy mesh first. One fault at a time, each healed after `--cut` s:

- a decode worker cut from every other host mid-stream (its requests move across hosts);
- a decode worker cut from the etcd hosts only (its lease lapses while it still serves);
- an etcd member cut from the other two (a minority partition).

Every answer is checked against the catalogue. After each heal, time-to-recover is how long
until the cut instance is registered in etcd again (for the etcd member: until it answers a
read that needs a quorum again). Goals: 0 corrupted, 0 failed, every recovery within the lease TTL + 2 s.
Exits 0 when they hold, 1 when not, 2 where namespaces cannot be made (with the reason).
Not built yet: a processor cut from one of two routers, a prefill worker cut during a NIXL
transfer, packet loss on a link (nftables), and NIXL throughput between hosts.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.common.report import table
from bench.hosts.mesh import ETCD_CLIENT_PORT, HostsMesh, isolate, rejoin
from bench.hosts.netns import Bed, Host, unavailable
from services.mesh.discovery import DECODE_WORKER
from services.mesh.etcd_lease import LeaseConfig

MODEL = "kvmesh-demo"
CATALOGUE = 16
TOKENS = 120
RECOVER_GOAL_S = LeaseConfig().ttl_s + 2.0
RECOVER_TIMEOUT_S = 60.0


@dataclass
class Tally:
    sent: int = 0
    exact: int = 0
    corrupted: int = 0
    failed: list[str] = field(default_factory=list)


@dataclass
class Row:
    fault: str
    tally: Tally
    recover_s: float


async def _answer(client: httpx.AsyncClient, base: str, prompt: str) -> str:
    r = await client.post(f"{base}/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": TOKENS})
    r.raise_for_status()
    return str(r.json()["choices"][0]["text"])


async def _load(client: httpx.AsyncClient, base: str, expected: dict[str, str], rate: float, stop: asyncio.Event,
                tally: Tally) -> None:
    rng = random.Random(7)
    running: set[asyncio.Task[None]] = set()

    async def one(prompt: str) -> None:
        tally.sent += 1
        try:
            text = await _answer(client, base, prompt)
        except httpx.HTTPError as exc:
            tally.failed.append(f"{type(exc).__name__}: {exc}"[:200])
            return
        if text == expected[prompt]:
            tally.exact += 1
        else:
            tally.corrupted += 1

    while not stop.is_set():
        task = asyncio.create_task(one(rng.choice(list(expected))))
        running.add(task)
        task.add_done_callback(running.discard)
        try:
            await asyncio.wait_for(stop.wait(), rng.expovariate(rate))
        except TimeoutError:
            pass
    if running:
        await asyncio.wait(running, timeout=120)


async def _registered(mesh: HostsMesh, host: Host) -> bool:
    try:
        workers = await mesh.instances(DECODE_WORKER)
    except Exception:  # noqa: BLE001 - etcd busy for a moment: not registered yet, ask again
        return False
    return any(i.address.startswith(f"{host.address}:") for i in workers)


async def _member_serves(mesh: HostsMesh, host: Host) -> bool:
    """The member answers a read that needs a quorum: it is part of the cluster again."""
    try:
        await mesh.instances(DECODE_WORKER, (f"http://{host.address}:{ETCD_CLIENT_PORT}",))
    except Exception:  # noqa: BLE001 - still cut off from the quorum: ask again
        return False
    return True


async def _recovered(check: Callable[[], Awaitable[bool]]) -> float:
    healed = time.monotonic()
    while time.monotonic() - healed < RECOVER_TIMEOUT_S:
        if await check():
            return time.monotonic() - healed
        await asyncio.sleep(0.2)
    return float("inf")


async def run(workers: int, cut_s: float, rate: float) -> list[Row]:
    run_dir = Path(tempfile.mkdtemp(prefix="kvmesh-hosts-"))
    print(f"hosts: {4 + workers} namespaces, logs in {run_dir}", flush=True)
    with Bed(4 + workers) as bed:
        mesh = HostsMesh(bed, run_dir)
        try:
            await mesh.start()
            return await _faults(mesh, cut_s, rate)
        finally:
            await mesh.stop()


async def _faults(mesh: HostsMesh, cut_s: float, rate: float) -> list[Row]:
    hosts = mesh.bed.hosts
    worker_a, worker_b = mesh.worker_hosts[0], mesh.worker_hosts[-1]
    etcd_member = mesh.etcd_hosts[0]
    faults: list[tuple[str, Host, list[Host], Callable[[], Awaitable[bool]]]] = [
        ("decode worker cut from every host, mid-stream", worker_a, [h for h in hosts if h is not worker_a],
         lambda: _registered(mesh, worker_a)),
        ("decode worker cut from etcd only", worker_b, mesh.etcd_hosts, lambda: _registered(mesh, worker_b)),
        ("etcd member cut from the other two", etcd_member, mesh.etcd_hosts[1:],
         lambda: _member_serves(mesh, etcd_member)),
    ]
    rows = []
    async with httpx.AsyncClient(timeout=120) as client:
        prompts = [f"hosts {i}: " + "lorem ipsum " * (i % 5 + 1) for i in range(CATALOGUE)]
        expected = dict(zip(prompts, await asyncio.gather(*(_answer(client, mesh.base_url, p) for p in prompts)),
                            strict=True))
        for name, victim, others, check in faults:
            print(f"hosts: {name} for {cut_s:.0f}s ...", flush=True)
            tally, stop = Tally(), asyncio.Event()
            load = asyncio.create_task(_load(client, mesh.base_url, expected, rate, stop, tally))
            await asyncio.sleep(1.0)
            isolate(victim, others)
            try:
                await asyncio.sleep(cut_s)
            finally:
                rejoin(victim, others)
            recover_s = await _recovered(check)
            stop.set()
            await load
            rows.append(Row(name, tally, recover_s))
            print(f"hosts: {name}: {tally.exact}/{tally.sent} exact, {tally.corrupted} corrupted, "
                  f"{len(tally.failed)} failed, recovered {recover_s:.1f}s after the heal", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make chaos ARGS=\"--hosts ...\"", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="decode workers, one host each")
    p.add_argument("--cut", type=float, default=12.0, help="seconds each fault lasts (above the 10 s lease TTL)")
    p.add_argument("--rate", type=float, default=4.0, help="requests per second of steady load")
    args = p.parse_args(argv)
    why = unavailable()
    if why is not None:
        print(f"hosts: cannot make hosts here: {why}", file=sys.stderr)
        return 2
    rows = asyncio.run(run(max(2, args.workers), args.cut, args.rate))
    table(f"Faults across hosts (each healed after {args.cut:.0f}s; recovery goal {RECOVER_GOAL_S:.0f}s)",
          ["fault", "requests", "exact", "corrupted", "failed", "time to recover (s)"],
          [[r.fault, r.tally.sent, r.tally.exact, r.tally.corrupted, len(r.tally.failed), f"{r.recover_s:.1f}"]
           for r in rows])
    for r in rows:
        for failure in r.tally.failed[:3]:
            print(f"  {r.fault}: {failure}")
    ok = all(not r.tally.corrupted and not r.tally.failed and r.recover_s <= RECOVER_GOAL_S for r in rows)
    print(f"goal: 0 corrupted, 0 failed, every recovery within {RECOVER_GOAL_S:.0f}s: {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
