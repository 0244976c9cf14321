"""The one exception a bad setting raises, and how a process exits on one (their own module so
every config module, and tracing, can use them without the flags)."""

from __future__ import annotations

import sys
from typing import NoReturn

# A process's exit status for flags or settings that cannot work, and for a mesh it cannot reach.
EXIT_BAD_FLAGS = 2
EXIT_UNREACHABLE = 3


class ConfigError(ValueError):
    """A setting that cannot work; the message is one line and names the flag."""


def die(reason: str, code: int = EXIT_BAD_FLAGS) -> NoReturn:
    """Exits with a single-line reason: `error: <reason>` on stderr."""
    print(f"error: {reason}", file=sys.stderr, flush=True)
    raise SystemExit(code)
