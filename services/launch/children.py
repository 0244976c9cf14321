"""Child processes of the launcher: started with prefixed output, stopped in order, never orphaned."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.mesh.process_tree import die_with_parent
from services.mesh.tasks import cancel_and_wait

TAIL_LINES = 30
# How long a child's output is still read after it exited (see Child.wait).
OUTPUT_DRAIN_S = 2.0


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
            preexec_fn=_prepare_child,
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

    def kill_leftovers(self) -> None:
        """SIGKILLs whatever is left of the child's process group (it has exited itself)."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        print(f"{self.component} pid={self.process.pid} left processes behind; killed them",
              file=sys.stderr, flush=True)

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
                print(f"{self.component} pid={self.process.pid} ignored SIGTERM for {timeout_s:.0f}s; killing it",
                      file=sys.stderr, flush=True)
                self.process.kill()
                await self.process.wait()
        self.kill_leftovers()
        await self.wait()


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env
