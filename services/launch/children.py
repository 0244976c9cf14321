"""Child processes of the launcher: output to a log file (and the console when it matters),
stopped in order, never orphaned."""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import signal
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from services.launch import INHERITED_FORK_SUPPORT
from services.launch.console import Console
from services.launch.output_filter import LineSplitter, OutputFilter, parse
from services.mesh.process_tree import die_with_parent
from services.mesh.tasks import cancel_and_wait

TAIL_LINES = 30
# How long a child's output is still read after it exited (see Child.wait).
OUTPUT_DRAIN_S = 2.0
# Output is read in chunks, not lines: a line has no length limit (see LineSplitter).
READ_CHUNK = 64 * 1024


def _prepare_child() -> None:
    """Runs in the child before exec. Its own process group: whatever it starts (vLLM's engine
    processes) can be found and ended with it, even if it dies without ending them. And the
    kernel sends it SIGTERM (it drains) if the launcher dies."""
    os.setpgid(0, 0)
    die_with_parent(signal.SIGTERM)


@dataclass
class Child:
    component: str
    argv: Sequence[str]
    env: dict[str, str] | None = None
    # What the child prints or logs once it serves (see readiness.py), matched against each
    # line's message.
    ready_when: re.Pattern[str] | None = None
    # The launcher waits for this child's ready line before it asks the frontend for /health.
    ready_required: bool = False
    # Every byte the child writes to stdout and stderr; appended to, so restarts keep history.
    log_path: Path | None = None
    console: Console = field(default_factory=Console)
    process: asyncio.subprocess.Process | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    ready: bool = False
    # The message that made the child ready (a worker's names its instance ids).
    ready_message: str = ""
    _started_at: float = 0.0
    _pump: asyncio.Task[None] | None = None

    async def start(self) -> None:
        log = _LogFile.open(self.log_path)
        try:
            self.process = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=self.env,
                preexec_fn=_prepare_child,
            )
        except BaseException:
            log.close()
            raise
        self.ready = False
        self.ready_message = ""
        self._started_at = time.monotonic()
        log.write(f"---- {time.strftime('%Y-%m-%d %H:%M:%S')} {self.component} started pid={self.process.pid}: "
                  f"{shlex.join(self.argv)}\n".encode())
        self._pump = asyncio.create_task(self._read_output(self.process, log), name=f"output-{self.component}")
        self.console.status(f"CHILD {self.component} pid={self.process.pid}")

    async def _read_output(self, process: asyncio.subprocess.Process, log: _LogFile) -> None:
        assert process.stdout is not None
        lines, console_filter = LineSplitter(), OutputFilter()
        try:
            while chunk := await process.stdout.read(READ_CHUNK):
                log.write(chunk)
                for line in lines.feed(chunk):
                    self._on_line(process.pid, line, console_filter)
            for line in lines.flush():
                self._on_line(process.pid, line, console_filter)
        finally:
            log.close()

    def _on_line(self, pid: int, text: str, console_filter: OutputFilter) -> None:
        self.tail.append(text)
        important = console_filter.shows(text)
        self.console.child_line(self.component, pid, text, important=important)
        if self.ready_when is not None and not self.ready and self.ready_when.search(message := parse(text).message):
            self.ready_message = message
            self.mark_ready()

    def mark_ready(self) -> None:
        """Prints the child's ready line, once per start."""
        if self.ready or self.process is None:
            return
        self.ready = True
        self.console.ready(self.component, self.process.pid, time.monotonic() - self._started_at)

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.returncode

    async def wait(self) -> int:
        """The child's exit status, once it has exited and its output is read.

        A process the child left behind may hold the output pipe open forever: the rest of the
        output gets a short while, then the reading stops."""
        assert self.process is not None
        code = await self.process.wait()
        if self._pump is not None:
            done, _ = await asyncio.wait([self._pump], timeout=OUTPUT_DRAIN_S)
            if not done:
                await cancel_and_wait(self._pump)
        return code

    def kill_leftovers(self, report: bool = True) -> None:
        """SIGKILLs whatever is left of the child's process group (it has exited itself)."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        if report:
            self.console.note(f"{self.component} pid={self.process.pid} left processes behind; killed them")

    async def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (the child drains), SIGKILL if it has not exited within the timeout, then
        SIGKILL for anything it left in its process group."""
        if self.process is None:
            return
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), timeout_s)
            except TimeoutError:
                self.console.note(f"{self.component} pid={self.process.pid} ignored SIGTERM for {timeout_s:.0f}s; "
                                  "killing it")
                self.process.kill()
                await self.process.wait()
        # Not reported: after a stop, vLLM's engine processes are often still on their way out
        # (they end on their parent's death, a moment after it).
        self.kill_leftovers(report=False)
        await self.wait()


class _LogFile:
    """A child's log file, flushed at every write (`tail -f` sees each line as it comes, a
    launcher crash loses nothing). A file that cannot be opened or written (a full disk) ends
    the logging, not the mesh."""

    def __init__(self, file: BinaryIO | None) -> None:
        self._file = file

    @classmethod
    def open(cls, path: Path | None) -> _LogFile:
        try:
            return cls(None if path is None else path.open("ab"))
        except OSError:
            return cls(None)

    def write(self, data: bytes) -> None:
        if self._file is None:
            return
        try:
            self._file.write(data)
            self._file.flush()
        except OSError:
            self.close()

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            try:
                file.close()
            except OSError:
                pass  # what it could not flush is lost; the console still showed what mattered


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    if INHERITED_FORK_SUPPORT is None:
        env.pop("GRPC_ENABLE_FORK_SUPPORT", None)
    else:
        env["GRPC_ENABLE_FORK_SUPPORT"] = INHERITED_FORK_SUPPORT
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env
