"""Stand-ins for the parts of a session a test of one call's stream does not exercise."""

from __future__ import annotations

from services.mesh.hop_latency import FrameClock
from services.mesh.session_client import SessionLimits, SessionStream


class StandInSession:
    """What a SessionStream asks of its session when a response is buffered or read."""

    def __init__(self) -> None:
        self.buffered = 0
        self.limits = SessionLimits()
        self.streams: dict[int, SessionStream] = {}
        self.clock = FrameClock()
