"""python -m services.worker.reaper PID: ends what a dead worker leaves behind.

vLLM runs its engine in processes it spawns (an EngineCore, and workers under it). When the
worker that owns them is SIGKILLed nothing tells them: they are reparented to init and keep a
core busy and gigabytes held. Nothing of ours runs inside them, so the worker starts this small
process beside its engine instead: it keeps a list of the worker's descendants, and the moment
the worker is gone (the kernel's parent-death signal, or its parent changing) it SIGKILLs every
one still alive, then exits. After a normal shutdown the engine processes are already gone and
there is nothing to kill.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from services.mesh.process_tree import die_with_parent

POLL_S = 0.5


def descendants(pid: int) -> set[int]:
    """Every live process under `pid`, from the kernel's per-thread children lists."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        current = todo.pop()
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    todo.append(child)
    return found


def kill_all(pids: set[int]) -> int:
    killed = 0
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except (ProcessLookupError, PermissionError):
            pass
    return killed


def main() -> None:
    worker = int(sys.argv[1])
    me = os.getpid()
    gone = False

    def worker_died(signum: int, frame: object) -> None:
        nonlocal gone
        gone = True

    signal.signal(signal.SIGTERM, worker_died)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the worker's to handle
    die_with_parent(signal.SIGTERM)
    known: set[int] = set()
    while not gone and os.getppid() == worker:
        known = descendants(worker) - {me}
        time.sleep(POLL_S)
    killed = kill_all(known)
    if killed:
        print(f"reaper: worker {worker} is gone; killed {killed} process(es) it left behind", file=sys.stderr,
              flush=True)


if __name__ == "__main__":
    main()
