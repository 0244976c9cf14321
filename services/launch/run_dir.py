"""Where a launch keeps its children's output: one directory per run, one log file per process.

Layout (`--run-dir DIR` uses DIR itself instead of a new directory under `.cache/runs/`):

    .cache/runs/<YYYYmmdd-HHMMSS>-<launcher pid>/
        launch.log             the launcher's own console lines (CHILD, ready, READY, notes)
        etcd.log               the embedded etcd (when it starts one)
        kv-router.log          one file per process, named after its component,
        processor.log          replicas numbered from 1 (processor-1.log, processor-2.log)
        decode-worker.log      mocker workers share one process, so one file
        prefill-worker.log
        frontend.log
    .cache/runs/latest -> <the newest run>

A file holds the process's stdout and stderr as written; a restarted process appends to the
same file after a `---- ... started pid=N` header, so a crash and its aftermath read in order.
Only the newest `KEEP_RUNS` runs are kept (a run whose launcher still lives is never removed).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

RUNS_DIR = Path(".cache/runs")
# Only what a launch created is ever pruned.
_RUN_NAME = re.compile(r"^\d{8}-\d{6}-\d+$")
KEEP_RUNS = 20
LATEST = "latest"


def create_run_dir(chosen: Path | None = None) -> Path:
    """The run directory, created: `chosen`, or a new one under `.cache/runs/` (a temporary
    directory if that cannot be written)."""
    if chosen is not None:
        chosen.mkdir(parents=True, exist_ok=True)
        return chosen.resolve()
    base = RUNS_DIR.resolve()
    try:
        base.mkdir(parents=True, exist_ok=True)
        path = base / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        path.mkdir()
    except OSError:
        return Path(tempfile.mkdtemp(prefix="kvmesh-run-"))
    _prune(base, keep=path)
    _point_latest(base, path)
    return path


def log_names(components: list[str]) -> list[str]:
    """A log file name per process, in order: the component, numbered when it has replicas."""
    totals = Counter(components)
    seen: Counter[str] = Counter()
    names = []
    for component in components:
        seen[component] += 1
        names.append(f"{component}-{seen[component]}.log" if totals[component] > 1 else f"{component}.log")
    return names


def _prune(base: Path, keep: Path) -> None:
    runs = sorted((p for p in base.iterdir() if _RUN_NAME.match(p.name) and not p.is_symlink() and p != keep),
                  reverse=True)
    for old in runs[KEEP_RUNS - 1:]:
        if not _launcher_alive(old):
            shutil.rmtree(old, ignore_errors=True)


def _launcher_alive(run: Path) -> bool:
    pid = run.name.rsplit("-", 1)[-1]
    return pid.isdigit() and Path(f"/proc/{pid}").exists()


def _point_latest(base: Path, path: Path) -> None:
    """Replaces the `latest` link atomically (concurrent launches race for it; one wins)."""
    tmp = base / f".{LATEST}-{os.getpid()}"
    try:
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(path.name)
        tmp.replace(base / LATEST)
    except OSError:
        tmp.unlink(missing_ok=True)
