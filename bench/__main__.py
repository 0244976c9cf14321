"""make bench: every benchmark in one run (or `--only NAME`)."""

from __future__ import annotations

import argparse

from bench import disagg_serving, mesh_overhead
from bench.agents import cli as agents
from bench.hot_path import detokenize, http_edge, one_worker, request_profile
from bench.hot_path import run as hot_path
from bench.indexer import run as indexer
from bench.lora import run as lora
from bench.moves import run as moves
from bench.multimodal import run as multimodal
from bench.nixl import run as nixl
from bench.overload import run as overload
from bench.planner import run as planner
from bench.routing import run as routing
from bench.tiers import run as tiers

# One module per single-file benchmark; a folder (its `run` module) per benchmark with parts.
BENCHMARKS = {
    "mesh": mesh_overhead.run,
    "indexer": indexer.run,
    "routing": routing.run,
    "nixl": nixl.run,
    "disagg": disagg_serving.run,
    "hot-path": hot_path.run,
    "one-worker": one_worker.run,
    "request-profile": request_profile.run,
    "detokenize": detokenize.run,
    "http-edge": http_edge.run,
    "planner": planner.run,
    "tiers": tiers.run,
    "overload": overload.run,
    "lora": lora.run,
    "multimodal": multimodal.run,
    "agents": agents.run_all,
    "moves": moves.run,
}


# Run by name only: "hot-path" runs it too.
PARTS = {"one-worker", "request-profile"}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--only", choices=sorted(BENCHMARKS), action="append")
    args = parser.parse_args()
    for name in args.only or [n for n in BENCHMARKS if n not in PARTS]:
        BENCHMARKS[name]()
    print("\nplots and JSON in bench/results/")


if __name__ == "__main__":
    main()
