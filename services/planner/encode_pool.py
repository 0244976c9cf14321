"""The encode pool's size (E/P/D): enough encode workers that an image seldom waits for one.

An encode worker runs one image at a time (its engine's encoder), so the pool is a queue with
`n` servers: images arrive at rate lambda (those the workers that prefill asked the pool for,
plus those they encoded in place for want of an encode worker), each takes s seconds (measured
at the encode workers: their busy seconds over the images they encoded). The mean wait in an
M/M/n queue is Erlang's C formula, Wq = C(n, a) * s / (n - a), a = lambda * s. The pool gets the
fewest workers whose predicted wait fits the budget, a share of the TTFT objective (the wait
adds to the first token of every image request), grows as soon as it falls short, and shrinks
only to a size whose wait is within `headroom` of the budget (hysteresis, as the other pools).

Before any encode worker has measured s (the pool is empty, or served nothing yet), images
asked for are enough to start one; an idle pool goes down to its minimum. The model leaves out
the encoder cache: an image found there costs little, and is counted in s as it is measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.config_error import ConfigError

# The share of the TTFT objective an image may spend waiting for an encode worker.
WAIT_SHARE_OF_TTFT = 0.1


@dataclass(frozen=True)
class EncodeLimits:
    """`max_workers` 0: the planner leaves the encode pool as it is."""

    min_workers: int = 0
    max_workers: int = 0

    def __post_init__(self) -> None:
        if self.min_workers < 0 or self.max_workers < 0:
            raise ConfigError("--min-encode-workers and --max-encode-workers must be >= 0")
        if self.min_workers > self.max_workers:
            raise ConfigError("--min-encode-workers must be <= --max-encode-workers (0: the encode pool "
                              "is not sized)")

    @property
    def sized(self) -> bool:
        return self.max_workers > 0


@dataclass(frozen=True)
class EncodeTraffic:
    """What the pool was asked over the last interval."""

    # Images the workers that prefill wanted encoded by the pool (served there or, for want of
    # an encode worker, in place), per second.
    rate_per_s: float = 0.0
    # The encode workers' mean busy seconds per image (None: none measured).
    service_s: float | None = None

    @property
    def idle(self) -> bool:
        return self.rate_per_s <= 0


def erlang_c_wait(rate_per_s: float, service_s: float, servers: int) -> float:
    """The mean wait for a server in an M/M/`servers` queue (inf when it cannot keep up)."""
    if rate_per_s <= 0 or service_s <= 0:
        return 0.0
    offered = rate_per_s * service_s
    if servers <= 0 or offered >= servers:
        return math.inf
    # sum_{k<n} a^k/k! and a^n/n!, term by term (no factorials to overflow).
    term, below = 1.0, 0.0
    for k in range(servers):
        below += term
        term *= offered / (k + 1)
    tail = term * servers / (servers - offered)
    waiting = tail / (below + tail)
    return waiting * service_s / (servers - offered)


def encode_pool_size(current: int, traffic: EncodeTraffic, limits: EncodeLimits, budget_s: float,
                     headroom: float) -> tuple[int, str]:
    """The pool's next size and why (one phrase for the planner's log line)."""
    low, high = limits.min_workers, limits.max_workers
    if traffic.idle:
        return low, "no images to encode"
    floor = max(low, 1)
    service_s = traffic.service_s
    if service_s is None:
        return max(current, floor), "images to encode, none measured yet"

    def wait(n: int) -> float:
        return erlang_c_wait(traffic.rate_per_s, service_s, n)

    needed = next((n for n in range(floor, high + 1) if wait(n) <= budget_s), high)
    if current < needed:
        return needed, f"an image would wait {wait(current) * 1000:.0f} ms for an encode worker"
    relaxed = next((n for n in range(floor, high + 1) if wait(n) <= headroom * budget_s), high)
    return (relaxed if current > relaxed else min(current, high)), "encode waits within budget"
