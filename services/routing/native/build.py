"""Builds the native index in place: `python -m services.routing.native.build`.

Compiles kvtree.c (with its headers) into `_kvtree<EXT_SUFFIX>` beside it, with the compiler and
Python headers this interpreter was built with (sysconfig), so nothing beyond a C compiler and
the Python headers is needed (`CC` in the environment picks another compiler). The shared object
is a build output (.gitignore). Exits non-zero, saying why, when it cannot build: the router
then runs the Python radix tree (index_choice.py).
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "kvtree.c"
FLAGS = ["-O2", "-std=gnu11", "-fPIC", "-shared", "-Wall", "-Wextra", "-Wno-unused-parameter",
         "-Wno-missing-field-initializers", "-fvisibility=hidden"]


def sources_digest() -> str:
    """A digest of the C sources: built into the module, and compared at import, so a build left
    behind by older sources (a `git pull` without `make install`) is refused, not run."""
    digest = hashlib.sha256()
    for path in sorted(HERE.glob("*.[ch]")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def target() -> Path:
    return HERE / ("_kvtree" + str(sysconfig.get_config_var("EXT_SUFFIX") or ".so"))


def build() -> Path:
    """Compiles the extension; raises RuntimeError with the compiler's complaint on failure."""
    compiler = shlex.split(os.environ.get("CC") or str(sysconfig.get_config_var("CC") or "cc"))
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        raise RuntimeError(f"no Python.h in {include}: install the Python development headers")
    out = target()
    partial = out.with_suffix(".partial")
    argv = [*compiler, *FLAGS, f'-DKVTREE_SOURCES="{sources_digest()}"', f"-I{include}", str(SOURCE), "-o", str(partial)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    except OSError as exc:
        raise RuntimeError(f"cannot run the C compiler {compiler[0]}: {exc}") from exc
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} failed:\n{done.stderr.strip()}")
    partial.replace(out)  # in one step: a process importing it never sees half a file
    return out


def main() -> int:
    try:
        out = build()
    except RuntimeError as exc:
        print(f"native index: not built ({exc}); the router will use the Python radix tree", file=sys.stderr)
        return 1
    print(f"native index: built {out.relative_to(HERE.parents[2])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
