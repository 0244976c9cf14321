"""The planner's flags, declared once for the planner and the launcher.

`add_planner_flags` is the planning group the launcher also offers (and forwards); the
connector's own flags (`add_connector_flags`) belong to the planner process alone: the launcher
chooses the connector with `--planner` and wires the local one itself.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from services.config_error import ConfigError
from services.mesh.config_error import validated
from services.mesh.flags import non_negative_float, non_negative_int, positive_float, positive_int
from services.planner.encode_pool import EncodeLimits
from services.planner.policy import Limits, Slo
from services.profiles.cost_model import CostModel, ProfileError
from services.profiles.profile_file import DEFAULT_PRESET, load_profile, preset_names

CONNECTORS = ("none", "local", "kubernetes")
_LIMITS = Limits()


def add_planner_flags(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    g = parser.add_argument_group("planner")
    g.add_argument("--ttft-slo-ms", type=positive_float, default=500.0, help="time-to-first-token objective")
    g.add_argument("--itl-slo-ms", type=positive_float, default=50.0, help="inter-token latency objective")
    g.add_argument("--adjustment-interval", type=positive_float, default=10.0,
                   help="seconds between two plans (the traffic is measured over this window)")
    g.add_argument("--profile", default=None, metavar="FILE",
                   help=f"the workers' profile the predictions start from (a file python -m services.planner "
                        f"profile wrote, or a preset: {', '.join(preset_names())}), calibrated by what the mesh "
                        f"shows (default {DEFAULT_PRESET}; the launcher passes the mocker's timing)")
    g.add_argument("--profile-speedup", type=positive_float, default=None,
                   help="divides the profile's durations, as the mocker's --speedup does (default 1; the "
                        "launcher passes the mocker's)")
    g.add_argument("--min-prefill-workers", type=non_negative_int, default=_LIMITS.min_prefill)
    g.add_argument("--max-prefill-workers", type=positive_int, default=_LIMITS.max_prefill)
    g.add_argument("--min-decode-workers", type=positive_int, default=_LIMITS.min_decode)
    g.add_argument("--max-decode-workers", type=positive_int, default=_LIMITS.max_decode)
    g.add_argument("--total-workers", type=positive_int, default=None,
                   help="a fixed budget: keep this many workers and only switch their roles")
    g.add_argument("--cooldown", type=non_negative_float, default=_LIMITS.cooldown_s,
                   help="seconds a pool keeps a new size before it may change again")
    g.add_argument("--scale-down-headroom", type=positive_float, default=_LIMITS.headroom,
                   help="a pool shrinks only if the smaller size predicts at most this share of its SLO")
    g.add_argument("--min-encode-workers", type=non_negative_int, default=_LIMITS.encode.min_workers,
                   help="the fewest encode workers (E/P/D) the planner keeps")
    g.add_argument("--max-encode-workers", type=non_negative_int, default=_LIMITS.encode.max_workers,
                   help="the most encode workers the planner starts (0: it leaves the encode pool alone; "
                        "with --planner local and --encode-workers N the launcher passes max(4, N) unless given)")
    g.add_argument("--switch-gain", type=positive_float, default=_LIMITS.switch_gain,
                   help="a fixed budget is re-split only if the new split scores below this share of the current")
    return g


def add_connector_flags(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    g = parser.add_argument_group("connector")
    g.add_argument("--connector", choices=CONNECTORS, default="none",
                   help="none: plan and export only (dry run); local: start, stop and switch a launcher's "
                        "workers; kubernetes: scale the worker Deployments")
    g.add_argument("--launcher", default=None, help="the launcher's control address HOST:PORT (--connector local)")
    g.add_argument("--k8s-namespace", default="default", help="namespace of the worker Deployments")
    g.add_argument("--k8s-prefill-deployment", default="prefill-worker")
    g.add_argument("--k8s-decode-deployment", default="decode-worker")
    return g


@dataclass(frozen=True)
class PlannerConfig:
    slo: Slo
    limits: Limits
    cost: CostModel
    interval_s: float

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ConfigError("--adjustment-interval must be > 0")


def planner_config(args: argparse.Namespace) -> PlannerConfig:
    def build() -> PlannerConfig:
        limits = Limits(min_prefill=args.min_prefill_workers, max_prefill=args.max_prefill_workers,
                        min_decode=args.min_decode_workers, max_decode=args.max_decode_workers,
                        total=args.total_workers, cooldown_s=args.cooldown, headroom=args.scale_down_headroom,
                        switch_gain=args.switch_gain,
                        encode=EncodeLimits(args.min_encode_workers, args.max_encode_workers))
        return PlannerConfig(Slo(args.ttft_slo_ms / 1000, args.itl_slo_ms / 1000), limits,
                             profile_cost(args.profile or DEFAULT_PRESET, args.profile_speedup or 1.0),
                             args.adjustment_interval)

    return validated(build)


def encode_pool_max(min_workers: int, max_workers: int) -> int:
    """The most encode workers the planner may run, once their limits are checked (ConfigError):
    the launcher checks a local planner's before it starts any child."""
    return EncodeLimits(min_workers, max_workers).max_workers


def profile_cost(name_or_path: str, speedup: float) -> CostModel:
    if not speedup > 0 or math.isinf(speedup):
        raise ConfigError("--profile-speedup must be a positive finite number")
    try:
        return load_profile(name_or_path).cost.scaled(1.0 / speedup)
    except ProfileError as exc:
        raise ConfigError(f"--profile: {exc}") from exc
