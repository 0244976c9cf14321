"""Children after start-up: stopped together at teardown (the front door first), and restarted
(or the mesh stopped) when one exits."""

from __future__ import annotations

import asyncio

from services.launch.children import Child
from services.mesh.service_runner import ServiceRunner

# Beyond its drain timeout, what a child gets to exit after SIGTERM before it is killed.
CHILD_EXIT_MARGIN_S = 10.0
# A child that exits is started again after this, doubling up to the maximum while it keeps dying.
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0


# While children stop, how often the console says which ones it still waits for.
STOP_PROGRESS_S = 3.0
# What takes requests from outside: it is stopped first, so nothing new comes in while the rest go.
FRONT_DOOR = "frontend"


class ChildrenStop:
    """Stops the launcher's children at teardown as fast as their dependencies allow.

    The front door (the frontends) goes first and finishes its requests. After that nothing sends
    work to the others, so they all drain and stop together, each within its own deadline (a vLLM
    worker takes seconds to shut its engine down; one after another, several took half a minute).
    The console says what is being stopped and, every few seconds, what it still waits for."""

    def __init__(self, drain_timeout_s: float) -> None:
        self._children: list[Child] = []
        self.stop_s = drain_timeout_s + CHILD_EXIT_MARGIN_S

    async def start(self, child: Child) -> None:
        await child.start()
        self._children.append(child)

    @property
    def teardown_s(self) -> float:
        """The longest the whole stop may take: two stages, each within one child's deadline."""
        return 2 * self.stop_s + 5

    async def stop_all(self) -> None:
        await self._stop_together([c for c in self._children if c.component == FRONT_DOOR])
        await self._stop_together([c for c in self._children if c.component != FRONT_DOOR])

    async def _stop_together(self, children: list[Child]) -> None:
        if not children:
            return
        console = children[0].console
        running = [c for c in children if c.returncode is None]
        if running:
            console.note(f"stopping {_names(running)}")
        stops = {asyncio.create_task(c.stop(self.stop_s), name=f"stop-{c.component}"): c for c in children}
        started = asyncio.get_running_loop().time()
        pending = set(stops)
        try:
            while pending:
                _, pending = await asyncio.wait(pending, timeout=STOP_PROGRESS_S)
                if pending:
                    waited = asyncio.get_running_loop().time() - started
                    console.note(f"still stopping {_names([stops[t] for t in pending])} ({waited:.0f}s)")
        finally:
            for task in pending:
                task.cancel()


def _names(children: list[Child]) -> str:
    return ", ".join(f"{c.component} pid={c.process.pid}" if c.process else c.component for c in children)


def supervise(runner: ServiceRunner, child: Child, policy: str) -> None:
    """Watches a child after start-up. When it exits: `restart` starts it again after a back-off
    that doubles with each exit in quick succession (the rest of the mesh serves on meanwhile);
    `exit` stops the whole mesh with exit status 1."""
    task = asyncio.create_task(keep_running(child, policy), name=f"supervise-{child.component}")
    runner.watch(task, f"the {child.component} process")


async def keep_running(child: Child, policy: str) -> None:
    backoff = RESTART_BACKOFF_S
    while True:
        started = asyncio.get_running_loop().time()
        code = await child.wait()
        child.kill_leftovers()  # what the dead child started must not outlive it
        pid = child.process.pid if child.process else "?"
        if policy != "restart":
            child.console.note(f"{child.component} pid={pid} exited with code {code}; stopping the mesh "
                               "(--on-child-exit exit)")
            return
        if asyncio.get_running_loop().time() - started > RESTART_BACKOFF_MAX_S:
            backoff = RESTART_BACKOFF_S  # it ran a good while: a fresh failure, not a crash loop
        child.console.note(f"{child.component} pid={pid} exited with code {code}; restarting it in {backoff:.0f}s")
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, RESTART_BACKOFF_MAX_S)
        await child.start()
