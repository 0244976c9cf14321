"""make bench: every benchmark in one run (or `--only NAME`)."""

from __future__ import annotations

import argparse

from bench import disagg_serving, hot_path, indexer, mesh_overhead, nixl_transfer, planner, routing_quality, tiers

BENCHMARKS = {
    "mesh": mesh_overhead.run,
    "indexer": indexer.run,
    "routing": routing_quality.run,
    "nixl": nixl_transfer.run,
    "disagg": disagg_serving.run,
    "hot-path": hot_path.run,
    "planner": planner.run,
    "tiers": tiers.run,
}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--only", choices=sorted(BENCHMARKS), action="append")
    args = parser.parse_args()
    for name in args.only or list(BENCHMARKS):
        BENCHMARKS[name]()
    print("\nplots and JSON in bench/results/")


if __name__ == "__main__":
    main()
