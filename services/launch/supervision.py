"""Children after start-up: each is stopped at teardown, and restarted (or the mesh stopped)
when it exits."""

from __future__ import annotations

import asyncio

from services.launch.children import Child
from services.mesh.service_runner import ServiceRunner

# Beyond its drain timeout, what a child gets to exit after SIGTERM before it is killed.
CHILD_EXIT_MARGIN_S = 10.0
# A child that exits is started again after this, doubling up to the maximum while it keeps dying.
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0


async def start_child(runner: ServiceRunner, child: Child, drain_timeout_s: float) -> None:
    """Starts a child; at teardown it gets SIGTERM, its drain timeout to finish, then SIGKILL."""
    await child.start()
    stop_s = drain_timeout_s + CHILD_EXIT_MARGIN_S
    runner.on_teardown(f"stop {child.component}", lambda: child.stop(stop_s), stop_s + 5)


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
