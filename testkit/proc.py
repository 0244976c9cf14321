"""The one child-process type of the tests and the benchmarks: `Proc`.

A child runs in the repository root with PYTHONUNBUFFERED=1 on top of this process's environment,
and its output (stdout and stderr together) is kept, so a failure can say what the child said
last. Kept where:
- in memory (the default): read line by line on a thread, in `lines`;
- in a log file (`log=`): the child writes it itself, so the file is whole even if this process
  dies, and nothing here reads it until asked (a run that keeps its logs: the chaos and hosts runs).

`group=True` starts the child in a session of its own and signals its whole process group (a
server that forks workers, as a side venv's may).

Waits come in two kinds: blocking (`wait_for`, `stop`), for tests and plain scripts, and polling
on the event loop (`wait_for_async`, `wait_async`, `stop_async`), for a run whose load, faults
and scrapers share one loop.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
POLL_S = 0.1


class ProcFailed(RuntimeError):
    """A child exited, or stayed silent, where it should have said something (its output's tail in
    the message)."""


class ProcTimeout(ProcFailed, TimeoutError):
    """A child stayed silent past its time."""


def python_module(module: str, *args: str) -> list[str]:
    """`python -m module args`, with this interpreter."""
    # Not services.launch.children's: importing services.launch sets GRPC_ENABLE_FORK_SUPPORT in
    # this process's environment, which every child here would inherit.
    return [sys.executable, "-m", module, *args]


class Proc:
    """A child process and its output. `role` names what it is to a mesh ("decode-worker",
    "etcd"); a mesh that starts it records the ids it announced (`ids`), when (`ready_at`), and
    what was done to it on purpose (`signalled`: "SIGKILL", "SIGTERM", or "")."""

    def __init__(self, argv: Sequence[str], name: str, env: dict[str, str] | None = None, *,
                 log: Path | None = None, role: str = "", cwd: Path | None = ROOT, group: bool = False) -> None:
        self.name = name
        self.role = role
        self.log_path = log
        self.group = group
        self.started_at = time.monotonic()
        self.ids: list[str] = []
        self.ready_at: float | None = None
        self.signalled = ""
        # SIGTERM was sent (terminate): `stop` waits for it rather than sending another, which
        # could land after the child's handlers are gone, as it exits, and kill it by the signal.
        self._terminated = False
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._lines: list[str] = []
        self._offset = 0  # of a log file: the bytes read into `_lines`
        self._cond = threading.Condition()
        self._reader: threading.Thread | None = None
        self.popen: subprocess.Popen[Any]
        if log is not None:
            with log.open("wb") as out:
                self.popen = subprocess.Popen(list(argv), cwd=cwd, env=full_env, stdin=subprocess.DEVNULL, stdout=out,
                                              stderr=subprocess.STDOUT, start_new_session=group)
        else:
            self.popen = subprocess.Popen(list(argv), cwd=cwd, env=full_env, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          errors="replace", start_new_session=group)
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with self._cond:
                self._lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    # -- what it is -------------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    # -- what it said -----------------------------------------------------------------------------

    @property
    def lines(self) -> list[str]:
        """Its output's lines so far (of a log file, the complete ones)."""
        self._catch_up()
        return self._lines

    def _catch_up(self) -> None:
        """Of a log file: the complete lines written since the last look, read into `_lines` (only
        what is new is read, so a wait may look often)."""
        if self.log_path is None:
            return
        with self._cond:
            try:
                with self.log_path.open("rb") as log:
                    log.seek(self._offset)
                    data = log.read()
            except OSError:
                return
            end = data.rfind(b"\n")
            if end < 0:
                return
            self._offset += end + 1
            self._lines.extend(line.rstrip("\r") for line in data[:end].decode(errors="replace").split("\n"))

    def tail(self, n: int = 60) -> str:
        self._catch_up()
        with self._cond:
            return "\n".join(self._lines[-n:])

    def mark(self) -> int:
        """Where its output is now: a wait `after` it looks only at lines still to come."""
        return len(self.lines)

    def _match(self, regex: re.Pattern[str], seen: int) -> tuple[re.Match[str] | None, int]:
        """The first line from index `seen` on that matches, and how many lines there are now."""
        lines = self.lines
        for line in lines[seen:]:
            if m := regex.search(line):
                return m, len(lines)
        return None, len(lines)

    def _finished(self) -> bool:
        """It exited and every line it wrote has been read."""
        return self.popen.poll() is not None and (self._reader is None or not self._reader.is_alive())

    def _look(self, regex: re.Pattern[str], seen: int, deadline: float,
              timeout_s: float) -> tuple[re.Match[str] | None, int, float]:
        """One look at the output from line `seen` on: the match (or None), the lines seen now, the
        seconds left; ProcFailed when the child exited first, ProcTimeout when no time is left."""
        finished = self._finished()  # before the look: a line written just before exiting counts
        m, seen = self._match(regex, seen)
        if m:
            return m, seen, 0.0
        if finished:
            raise ProcFailed(f"{self.name} exited ({self.popen.returncode}) before {regex.pattern!r}:\n{self.tail()}")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ProcTimeout(f"{self.name}: no {regex.pattern!r} within {timeout_s:g}s:\n{self.tail()}")
        return None, seen, remaining

    def wait_for(self, pattern: str, timeout_s: float, after: int = 0) -> re.Match[str]:
        """The first output line from index `after` on matching `pattern`; ProcFailed (with the
        output's tail) if the child exits first, ProcTimeout if the time runs out."""
        regex, deadline, seen = re.compile(pattern), time.monotonic() + timeout_s, after
        while True:
            with self._cond:
                m, seen, remaining = self._look(regex, seen, deadline, timeout_s)
                if m:
                    return m
                if self._reader is not None:  # in memory: woken by the next line
                    self._cond.wait(min(remaining, 0.5))
                    continue
            time.sleep(min(remaining, POLL_S))  # a log file: looked at again shortly

    async def wait_for_async(self, pattern: str, timeout_s: float, after: int = 0,
                             poll_s: float = POLL_S) -> re.Match[str]:
        """`wait_for` on the event loop: the output looked at every `poll_s`."""
        regex, deadline, seen = re.compile(pattern), time.monotonic() + timeout_s, after
        while True:
            m, seen, _ = self._look(regex, seen, deadline, timeout_s)
            if m:
                return m
            await asyncio.sleep(poll_s)

    # -- stopping it ------------------------------------------------------------------------------

    def send(self, sig: signal.Signals) -> None:
        """`sig` to the child (to its process group with `group`), if it still runs."""
        if self.popen.poll() is not None:
            return
        if self.group:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass
        else:
            self.popen.send_signal(sig)

    def terminate(self) -> None:
        """SIGTERM (a service drains); `stop` then waits for it."""
        self.send(signal.SIGTERM)
        self._terminated = True

    def kill(self) -> None:
        """SIGKILL, and the wait for it."""
        self.send(signal.SIGKILL)
        self.popen.wait(10)

    def stop(self, timeout_s: float = 20) -> int:
        """SIGTERM, SIGKILL after `timeout_s`; the exit status."""
        if self.popen.poll() is None:
            if not self._terminated:
                self.send(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.send(signal.SIGKILL)
                self.popen.wait(10)
        if self._reader is not None:
            self._reader.join(5)
        return self.popen.returncode

    async def wait_async(self, timeout_s: float) -> int | None:
        """The exit status, or None when it still runs after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.popen.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        return self.popen.poll()

    async def stop_async(self, timeout_s: float) -> int:
        """`stop` on the event loop; -999 when even SIGKILL left it running."""
        self.send(signal.SIGTERM)
        code = await self.wait_async(timeout_s)
        if code is None:
            self.send(signal.SIGKILL)
            code = await self.wait_async(10)
        return code if code is not None else -999
