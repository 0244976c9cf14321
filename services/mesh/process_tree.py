"""Engine processes never outlive their worker.

vLLM runs its engine in processes it starts with `spawn` (an EngineCore, and workers under it).
If the worker that owns them is SIGKILLed, nothing tells them: they are reparented to init and
keep a core busy and gigabytes held. The kernel's parent-death signal closes that gap: a process
that sets it is killed when its parent exits, however the parent died.

A spawned child re-imports the worker's main module under the name `__mp_main__` before it runs
anything else, which is where the worker modules call `die_with_parent()`; each generation does
the same for the one below, so a whole engine tree goes with its worker.
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: signal.Signals = signal.SIGKILL) -> None:
    """Asks the kernel to send `sig` to this process when its parent exits (Linux; elsewhere a no-op)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    parent = os.getppid()
    libc.prctl(PR_SET_PDEATHSIG, int(sig))
    # The parent may have died before the signal was armed: then nobody would send it.
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)
