"""Which lines of a child's output reach the launcher's quiet console.

Rule: a child's whole output goes to its log file; the console gets a line only when it says
something went wrong: a warning or worse logged by kvmesh's own code, an error or worse logged
by a library (vLLM, etcd, uvicorn, gRPC), a Python traceback, an `error: ...` one-liner (how
every service reports bad flags or an unreachable etcd before it exits), or a crash report
(`Fatal Python error`, a Go `panic:`), plus the indented lines that continue a line shown.
Libraries' warnings stay in the file because they describe the library's set-up, not the
mesh's health: vLLM on a CPU prints some thirty per worker at every start (no Triton, eager
mode, dtype casts), and a busy etcd warns of every slow disk write.

Log lines are recognised in every format a child writes: ours (`--log-format text`:
`time LEVEL component logger: msg`, or `json`: an object with `level`, `component`, `logger`),
vLLM's (`LEVEL mm-dd time [file:line] msg`, also behind a `(EngineCore pid=N)` prefix),
uvicorn's (`ERROR:    msg`), etcd's (zap JSON, `"level":"warn"`) and gRPC core's
(`W1122 02:36:01.8 ...]`). A line of no known shape (a progress bar, a print) stays in the file.
"""

from __future__ import annotations

import json
import logging
import re
from typing import NamedTuple

# A longer line is cut to this on the console and for matching (the log file keeps all of it):
# one runaway line must not hold the launcher's memory.
MAX_LINE_BYTES = 64 * 1024

_LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARN": logging.WARNING, "WARNING": logging.WARNING,
           "ERROR": logging.ERROR, "CRITICAL": logging.CRITICAL, "FATAL": logging.CRITICAL,
           "DPANIC": logging.CRITICAL, "PANIC": logging.CRITICAL}
_GLOG_LEVELS = {"I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}
# services/mesh/logs.py's text format: time, level, component, logger, message.
_OURS = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ([A-Z]+) (\S+) (\S+): ")
# Any other text log line: an optional `(process pid=N)` prefix, an optional date and time,
# then the level word, maybe in brackets, followed by a space, a colon, a bar or the end.
_TEXT_LEVEL = re.compile(r"^(?:\([^)]*\)\s+)?(?:\d[\d\-/:,.T]*(?:\s+\d[\d:,.]*)?\s+)?\[?"
                         r"(DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL)\]?(?=[\s:|]|$)")
_GLOG = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+:\d+\]")
_TRACEBACK_STARTS = ("Traceback (most recent call last):", "+ Exception Group Traceback",
                     "During handling of the above exception", "The above exception was the direct cause")
_ALERTS = ("error: ", "Error: ", "Fatal Python error", "panic: ", "fatal error: ")


class LogLine(NamedTuple):
    # None: not a log line.
    level: int | None
    # For JSON the `msg` field, otherwise the whole line.
    message: str
    # Logged by kvmesh's code rather than a library's.
    own: bool = False


def parse(line: str) -> LogLine:
    """The line's level, message and origin, in whichever of the formats above it is written."""
    if line.startswith("{"):
        try:
            entry = json.loads(line)
        except ValueError:
            entry = None
        if isinstance(entry, dict):
            level = entry.get("level", entry.get("levelname", entry.get("severity")))
            message = str(entry.get("msg", entry.get("message", line)))
            own = "component" in entry and _own_logger(str(entry.get("logger", "")), str(entry["component"]))
            return LogLine(_LEVELS.get(level.upper()) if isinstance(level, str) else None, message, own)
    if m := _OURS.match(line):
        return LogLine(_LEVELS.get(m.group(1)), line, _own_logger(m.group(3), m.group(2)))
    if m := _TEXT_LEVEL.match(line):
        return LogLine(_LEVELS[m.group(1)], line)
    if m := _GLOG.match(line):
        return LogLine(_GLOG_LEVELS[m.group(1)], line)
    return LogLine(None, line)


def _own_logger(logger: str, component: str) -> bool:
    """kvmesh's loggers: its modules' (`services.*`, `__main__`), the root logger, and those its
    entry points name after their component (`kv_router` in the kv-router)."""
    return logger.startswith("services.") or logger in ("root", "__main__", component.replace("-", "_"))


class OutputFilter:
    """One child's output, line by line: `shows(line)` says whether the console gets it.

    It keeps a little state, because what continues a line (a traceback, indented detail)
    shares that line's fate."""

    def __init__(self, own_threshold: int = logging.WARNING, library_threshold: int = logging.ERROR) -> None:
        self.own_threshold = own_threshold
        self.library_threshold = library_threshold
        self._in_traceback = False
        # Whether an indented line now continues a line that was shown.
        self._continuing = False

    def shows(self, line: str) -> bool:
        indented = line[:1] in (" ", "\t")
        if self._in_traceback:
            if indented or not line.strip():
                return True
            self._in_traceback = False
            if parse(line).level is None and not line.startswith(_TRACEBACK_STARTS):
                # Its last line, `SomeError: why` (an unindented log line would end it instead).
                self._continuing = False
                return True
        if line.lstrip().startswith(_TRACEBACK_STARTS):
            self._in_traceback = True
            return True
        if indented:
            return self._continuing
        level, _, own = parse(line)
        if level is not None:
            self._continuing = level >= (self.own_threshold if own else self.library_threshold)
        else:
            self._continuing = line.startswith(_ALERTS)
        return self._continuing


class LineSplitter:
    """Bytes read in chunks, cut into lines. Reading whole lines with `readline()` fails on a line
    over the stream's 64 KiB limit; here a longer line is cut to `limit` bytes and says how much
    was left out (the log file has it all)."""

    def __init__(self, limit: int = MAX_LINE_BYTES) -> None:
        self._limit = limit
        self._buf = bytearray()
        self._dropped = 0

    def feed(self, chunk: bytes) -> list[str]:
        lines: list[str] = []
        start = 0
        while start < len(chunk):
            end = chunk.find(b"\n", start)
            stop = len(chunk) if end < 0 else end
            room = max(0, self._limit - len(self._buf))
            self._buf += chunk[start:min(stop, start + room)]
            self._dropped += max(0, stop - start - room)
            if end < 0:
                break
            lines.append(self._emit())
            start = end + 1
        return lines

    def flush(self) -> list[str]:
        """The last line, when the output did not end with a newline."""
        return [self._emit()] if self._buf or self._dropped else []

    def _emit(self) -> str:
        text = self._buf.decode(errors="replace").rstrip("\r")
        if self._dropped:
            text += f" [... {self._dropped} more bytes in the log file]"
        self._buf.clear()
        self._dropped = 0
        return text
