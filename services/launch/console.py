"""What the launcher's terminal shows, and in which words.

On stdout, the lines scripts and tests parse (the CHILD and READY formats are fixed in docs/reference.md):

    LOGS <run dir>                                    where every child's full output goes
    CHILD <component> pid=<pid>                       a process started (again, after a restart)
    ready  <component>  pid=<pid>  (<seconds>s)       it serves (seconds since it was started)
    READY <base_url>                                  the mesh answers /health with 200

On stderr, the launcher's own notes and what children say at WARNING or above, tracebacks and
`error:` lines (see output_filter.py), each as `[<component> <pid>] <line>`. With `--verbose`
every line of every child is shown too, as before the run directory existed. The launcher's
own lines are also appended to `launch.log` in the run directory, so it tells the whole story.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TextIO

# Wide enough for the longest component name (`prefill-worker`), so ready lines align.
_NAME_WIDTH = 14


class Console:
    def __init__(self, verbose: bool = False, transcript: Path | None = None) -> None:
        self.verbose = verbose
        self._transcript = transcript

    def status(self, text: str) -> None:
        """A line for scripts: LOGS, CHILD, ready, READY."""
        self._write(sys.stdout, text)

    def note(self, text: str) -> None:
        """The launcher's own message (a restart, a child that would not stop, a start-up failure)."""
        self._write(sys.stderr, text)

    def ready(self, component: str, pid: int, seconds: float) -> None:
        self.status(f"ready  {component:<{_NAME_WIDTH}} pid={pid:<7} ({seconds:.1f}s)")

    def child_line(self, component: str, pid: int, text: str, *, important: bool) -> None:
        if important or self.verbose:
            sys.stderr.write(f"[{component} {pid}] {text}\n")
            sys.stderr.flush()

    def _write(self, stream: TextIO, text: str) -> None:
        # The file first: whoever saw a line on the console finds it in launch.log too.
        if self._transcript is not None:
            try:
                with self._transcript.open("a") as f:
                    f.write(f"{time.strftime('%H:%M:%S')} {text}\n")
            except OSError:
                self._transcript = None  # a full disk must not stop the mesh; the console still has it
        print(text, file=stream, flush=True)
