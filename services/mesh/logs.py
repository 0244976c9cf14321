"""Logging for every process: one line per event, tagged with the component."""

from __future__ import annotations

import logging
import sys

# Third-party chatter at INFO drowns the one-line-per-event logs of our own services.
QUIET_LOGGERS = ("httpx", "uvicorn.access", "aetcd", "hpack")


def setup_logging(level: str, component: str) -> None:
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)s {component} %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in QUIET_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.WARNING)
