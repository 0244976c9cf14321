"""How a process exits on a setting that cannot work (services/config_error.py's `ConfigError`)
or a mesh it cannot reach: their own module, so every config module, and tracing, can use them
without the flags."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn, TypeVar

from services.config_error import ConfigError

# A process's exit status for flags or settings that cannot work, and for a mesh it cannot reach.
EXIT_BAD_FLAGS = 2
EXIT_UNREACHABLE = 3

T = TypeVar("T")


def die(reason: str, code: int = EXIT_BAD_FLAGS) -> NoReturn:
    """Exits with a single-line reason: `error: <reason>` on stderr."""
    print(f"error: {reason}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def validated(build: Callable[[], T]) -> T:
    """Builds a config, exiting with its one-line reason when a setting cannot work."""
    try:
        return build()
    except ConfigError as exc:
        die(str(exc))
