"""What each hop adds to a streamed token's latency, without a profiler.

Every frame up a session (`*SessionUp.sent_unix_ns`) carries the wall-clock time it was written.
Each hop on the streaming path records, in `kvmesh_hop_latency_seconds{hop}`, the time from its
input to its output for the rows it makes:
- `decode_worker`: from a reply's making (for a token row, the engine step that made it) to the
  write of the frame that carries it;
- `processor`: from the worker frame's write to the write of the frame carrying the text rows
  made of it as it was read (the wire, the wait to be read, the detokenizing, the wait to be
  written); a reply a choice's own task makes (not a fast-lane row) counts from its making;
- `frontend`: from the processor frame's write to the event's hand-over to the client's
  connection.
A frame (or a gateway write) is one sample, for its oldest content. Hops on different hosts
compare wall clocks: their offset (NTP keeps it well under a millisecond on a LAN) is in the figure.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from services.mesh.fast_histogram import FastHistogram

# From 50 µs (a hop with nothing queued) to 10 s (a hop with a standing backlog: past its
# capacity, tokens wait in its buffers while the time between them still looks normal).
HOP_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
               2.5, 5.0, 10.0)


def hop_latency_histogram(registry: CollectorRegistry) -> FastHistogram:
    """The family each process registers once; each hop observes its own `hop` label."""
    return FastHistogram("kvmesh_hop_latency_seconds", "what this hop adds to a streamed token's latency",
                         HOP_BUCKETS, registry, ["hop"])


@dataclass
class FrameClock:
    """The upstream frame a process's session reader is handing out right now: its write time
    (0 outside a frame). Rows made while it is handed out are made of it."""

    reading_ns: int = 0


class HopLatency:
    """One hop's figure: `origin_ns()` when a reply is made, `record(origin)` when it leaves."""

    __slots__ = ("_observe", "_upstream")

    def __init__(self, histogram: FastHistogram, hop: str, upstream: FrameClock | None = None) -> None:
        self._observe = histogram.labels(hop).observe
        self._upstream = upstream

    def upstream_reading(self) -> bool:
        """An upstream frame is being handed out right now (a reply made now is made of it)."""
        return self._upstream is not None and self._upstream.reading_ns != 0

    def origin_ns(self) -> int:
        """Where a reply made now starts: the upstream frame being read, else now."""
        upstream = self._upstream
        return (upstream.reading_ns if upstream is not None else 0) or time.time_ns()

    def record(self, origin_ns: int, now_ns: int) -> None:
        self._observe(max(0, now_ns - origin_ns) / 1e9)
