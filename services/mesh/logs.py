"""Logging for every process: one line per event, tagged with the component and the request.

`--log-format text` writes `time LEVEL component logger: message [rid=...]`; `json` writes one
JSON object per line (`ts`, `level`, `component`, `logger`, `msg`, and `request_id` when the
line was logged while serving a request, `exc` with the traceback) for log collectors.
The request id comes from a context variable set where a request enters the process, so every
line logged on its behalf carries it without each call site passing it.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from contextvars import ContextVar

# Third-party chatter at INFO drowns the one-line-per-event logs of our own services.
QUIET_LOGGERS = ("httpx", "uvicorn.access", "aetcd", "hpack")

# The request being served by the current task (asyncio copies the context into each task).
REQUEST_ID: ContextVar[str | None] = ContextVar("kvmesh_request_id", default=None)


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


class LogComponent:
    """The component a process's log lines name: the role it serves now. A worker that switches
    roles renames it, so a line says who speaks, not who started."""

    def __init__(self, name: str) -> None:
        self.name = name


class TextFormatter(logging.Formatter):
    def __init__(self, component: LogComponent) -> None:
        super().__init__("%(asctime)s %(levelname)s %(component)s %(name)s: %(message)s")
        self._component = component

    def format(self, record: logging.LogRecord) -> str:
        record.component = self._component.name
        line = super().format(record)
        rid = getattr(record, "request_id", None)
        return f"{line} [rid={rid}]" if rid and rid not in record.getMessage() else line


class JsonFormatter(logging.Formatter):
    def __init__(self, component: LogComponent) -> None:
        super().__init__()
        self._component = component

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "component": self._component.name,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if rid:
            entry["request_id"] = rid
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(level: str, component: str, log_format: str = "text") -> LogComponent:
    """Sets up the process's logging; the returned name may be changed (a role switch)."""
    named = LogComponent(component)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(named) if log_format == "json" else TextFormatter(named))
    handler.addFilter(_RequestIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in QUIET_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return named
