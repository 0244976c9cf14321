"""The disaggregation flags, declared once for the decode worker and the launcher."""

from __future__ import annotations

import argparse
import enum

from services.decode_worker.disagg_decision import DisaggConfig
from services.mesh.config_error import validated
from services.mesh.flags import non_negative_int, positive_float

_DEFAULTS = DisaggConfig()


class DrainMode(enum.StrEnum):
    """What a decode worker does with its running requests when it drains (worker/handoff.py)."""

    # Hand them over with their KV (engines that can: `Engine.can_move`); otherwise they finish.
    MOVE = "move"
    # Let them finish within the drain timeout.
    FINISH = "finish"


def add_disagg_flags(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Returns the group, so the launcher can hand the same values to its decode workers."""
    g = parser.add_argument_group("disaggregated prefill")
    g.add_argument("--remote-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="prefill long prompts on prefill workers (default: on when KV transfer is on)")
    g.add_argument("--conditional-disagg", action=argparse.BooleanOptionalAction,
                   default=_DEFAULTS.conditional_disagg,
                   help="remote only for long uncached prompts and a short prefill queue (off: always remote)")
    g.add_argument("--max-local-prefill-length", type=non_negative_int, default=_DEFAULTS.max_local_prefill_length,
                   help="uncached prompt tokens above which the prefill goes remote")
    g.add_argument("--max-prefill-queue-size", type=non_negative_int, default=_DEFAULTS.max_prefill_queue_size,
                   help="prefill pool queue at which prompts are prefilled locally instead")
    g.add_argument("--prefill-timeout", type=positive_float, default=_DEFAULTS.prefill_timeout_s,
                   help="seconds a remote prefill may take before the prompt is prefilled locally")
    return g


def disagg_config(args: argparse.Namespace, can_receive_kv: bool) -> DisaggConfig:
    """`--remote-prefill` unset means: on exactly when this worker can receive KV (`--kv-transfer nixl`)."""
    remote = can_receive_kv if args.remote_prefill is None else args.remote_prefill
    return validated(lambda: DisaggConfig(
        remote_prefill=remote, conditional_disagg=args.conditional_disagg,
        max_local_prefill_length=args.max_local_prefill_length, max_prefill_queue_size=args.max_prefill_queue_size,
        prefill_timeout_s=args.prefill_timeout, can_receive_kv=can_receive_kv))


def add_drain_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--drain-mode", type=DrainMode, choices=list(DrainMode), default=DrainMode.MOVE,
                        help="at a drain (SIGTERM): move hands running requests over to other decode workers with "
                             "their KV (with --kv-transfer nixl; without it they finish), finish lets them finish "
                             "within --drain-timeout")
