"""Where a worker holds a cached KV block: part of the KV protocol, shared by engines (which emit
events), workers (which stream them) and the router (which indexes them).

A block evicted from the accelerator's memory may live on in host memory, from where loading it
back is cheaper than recomputing it; the router credits such a hit by what it saves.
"""

from __future__ import annotations

import enum


class Tier(enum.IntEnum):
    """The protobuf `KvTier` values (0, unspecified, is read as the device)."""

    DEVICE = 1
    HOST = 2

    @classmethod
    def from_wire(cls, value: int) -> Tier:
        return cls.HOST if value == cls.HOST else cls.DEVICE


def prefill_seconds(us_per_token: float, us_per_token_per_1k: float, start: int, end: int) -> float:
    """Prefill time of the prompt tokens at positions [start, end) on a worker where the token at
    position p costs `us_per_token + us_per_token_per_1k * p / 1000` microseconds (the second
    term is attention over the context before it)."""
    n = max(0, end - start)
    return (n * us_per_token + us_per_token_per_1k * (end * end - start * start) / 2000.0) / 1e6


def encoder_terms(encoder_blocks: float) -> str:
    """How a routing explanation shows what a candidate's encoder cache is worth to the prompt's
    images, in cached blocks: ` encoder=B`, or nothing when it keeps none of them."""
    return f" encoder={encoder_blocks:.2f}" if encoder_blocks else ""


def host_terms(host_overlap_blocks: int, host_credit: float) -> str:
    """How a routing explanation shows a candidate's host-held prompt blocks and what each is worth
    against a device block: ` host=N credit=C`, or nothing when it holds none there."""
    return f" host={host_overlap_blocks} credit={host_credit:.3f}" if host_overlap_blocks else ""
