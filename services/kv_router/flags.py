"""The router's flags, declared once for the router and the launcher, and its config."""

from __future__ import annotations

import argparse

from services.routing.cost_function import CostWeights
from services.routing.servicer import ROUTER_MODES, RouterConfig
from services.mesh.flags import non_negative_float, validated

_WEIGHTS = CostWeights()


def add_router_flags(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Returns the group, so the launcher can hand the same values to its routers."""
    g = parser.add_argument_group("routing")
    g.add_argument("--router-mode", choices=ROUTER_MODES, default=RouterConfig.mode)
    g.add_argument("--seed", type=int, default=None, help="seed for random tie-breaking (reproducible runs)")
    g.add_argument("--overlap-weight", type=float, default=_WEIGHTS.overlap,
                   help="cost function: weight of the cached share")
    g.add_argument("--cache-usage-weight", type=float, default=_WEIGHTS.cache_usage,
                   help="cost function: weight of KV cache usage")
    g.add_argument("--waiting-weight", type=float, default=_WEIGHTS.waiting,
                   help="cost function: weight of the normalized queue")
    g.add_argument("--router-temperature", type=non_negative_float, default=_WEIGHTS.temperature,
                   help="0 = best logit wins; > 0 = sample from softmax(logit / T)")
    g.add_argument("--host-overlap-weight", type=non_negative_float, default=None,
                   help="cost function: a fixed credit for a prefix block held in a worker's host memory "
                        "(0 = ignore the host tier; default: derived from what loading it back saves "
                        "against recomputing it)")
    return g


def router_config(args: argparse.Namespace) -> RouterConfig:
    weights = CostWeights(overlap=args.overlap_weight, cache_usage=args.cache_usage_weight,
                          waiting=args.waiting_weight, temperature=args.router_temperature,
                          host_overlap=args.host_overlap_weight)
    return validated(lambda: RouterConfig(mode=args.router_mode, seed=args.seed, weights=weights))
