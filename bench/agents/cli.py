"""The agents benchmark's entry points: `make bench ARGS="--only agents"` (`run_all`) and
`python -m bench.agents` (`main`): the synthetic trace (run.py), then the recorded clients'
sessions (run_clients.py)."""

from __future__ import annotations

import argparse
from dataclasses import replace

from bench.agents import run, run_clients


def run_all() -> dict:
    return {"synthetic": run.run(), "clients": run_clients.run_clients()}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.agents", description=run.__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small traces, one seed (development)")
    parser.add_argument("--seeds", type=int, default=None, help="run seeds 0..N-1")
    parser.add_argument("--modes", nargs="+", choices=list(run.MODES), default=list(run.DEFAULT_MODES))
    parser.add_argument("--clients", action="store_true",
                        help="only the run driven by recorded Claude Code and Codex sessions (run_clients.py)")
    args = parser.parse_args()
    clients = run_clients.QUICK if args.quick else run_clients.FULL
    if args.seeds is not None:
        clients = replace(clients, seeds=tuple(range(args.seeds)))
    if not args.clients:
        scale = run.QUICK if args.quick else run.FULL
        if args.seeds is not None:
            scale = run.Scale(scale.workload, tuple(range(args.seeds)), scale.send_limit_s)
        run.run(scale, tuple(args.modes))
    run_clients.run_clients(clients, tuple(args.modes))
