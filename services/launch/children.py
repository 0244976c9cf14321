"""Child processes of the launcher: started with prefixed output, stopped in order, never orphaned."""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

PR_SET_PDEATHSIG = 1
TAIL_LINES = 30


def _die_with_parent() -> None:
    """Runs in the child before exec: the kernel sends it SIGTERM if the launcher dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class Child:
    component: str
    argv: Sequence[str]
    env: dict[str, str] | None = None
    # A line the child prints once it serves (workers: "<component> ready: <ids>").
    ready_marker: str | None = None
    process: asyncio.subprocess.Process | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    ready: bool = False
    _pump: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=self.env,
            preexec_fn=_die_with_parent,
        )
        self._pump = asyncio.create_task(self._forward_output(), name=f"output-{self.component}")
        print(f"CHILD {self.component} pid={self.process.pid}", flush=True)

    async def _forward_output(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        prefix = f"[{self.component} {self.process.pid}] "
        while line := await self.process.stdout.readline():
            text = line.decode(errors="replace").rstrip("\n")
            self.tail.append(text)
            if self.ready_marker is not None and text.startswith(self.ready_marker):
                self.ready = True
            sys.stderr.write(prefix + text + "\n")
        sys.stderr.flush()

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.returncode

    async def wait(self) -> int:
        assert self.process is not None
        code = await self.process.wait()
        if self._pump is not None:
            await asyncio.gather(self._pump, return_exceptions=True)
        return code

    async def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if the child has not exited within the timeout."""
        if self.process is None or self.process.returncode is not None:
            if self._pump is not None:
                await asyncio.gather(self._pump, return_exceptions=True)
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.wait(), timeout_s)
        except TimeoutError:
            print(f"{self.component} pid={self.process.pid} ignored SIGTERM for {timeout_s:.0f}s; killing it",
                  file=sys.stderr, flush=True)
            self.process.kill()
            await self.wait()


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env
