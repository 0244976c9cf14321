"""The gateway's in-flight limit (--max-inflight), counted in generation streams.

A completions request with P prompts and n choices opens P x n streams to the processors and
weighs that much: the limit bounds the work the mesh holds for this gateway, whatever shape the
requests have. A request holds its weight from the moment it is accepted (before the processor
is called) until its lease is released, which happens exactly once on every path.
"""

from __future__ import annotations

from prometheus_client import Gauge

from services.frontend.errors import ApiError


class InflightLimit:
    def __init__(self, limit: int, gauge: Gauge) -> None:
        self.limit = limit
        self.count = 0
        self._gauge = gauge

    def acquire(self, streams: int) -> Lease:
        """A lease for `streams` streams: 429 while the gateway is too busy to take them (a retry
        may fit), 400 for a request heavier than the whole limit (no retry ever fits)."""
        if streams > self.limit:
            raise ApiError(400, f"the request opens {streams} completions; this gateway serves at most "
                                f"{self.limit} at once", param="n", code="invalid_value")
        if self.count + streams > self.limit:
            raise ApiError(429, "the gateway is at its concurrency limit; retry shortly", code="overloaded")
        self.count += streams
        self._gauge.inc(streams)
        return Lease(self, streams)

    def _release(self, streams: int) -> None:
        self.count -= streams
        self._gauge.dec(streams)


class Lease:
    """A request's share of the limit; `release` is idempotent, so every exit path may call it."""

    def __init__(self, owner: InflightLimit, streams: int) -> None:
        self._owner = owner
        self._streams = streams
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._owner._release(self._streams)
