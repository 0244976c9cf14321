"""`--check-config` for a whole mesh: the launcher's own flags (validated by `load`), then every
child's command line run through the child's own module with `--check-config`, so a flag the
launcher passes on is judged by the code that will parse it. Nothing is started: no etcd, no
service, no run directory. Exit 0 and print nothing, or exit 2 with one line
`error: <component>: <the child's reason>` (the first failing child, in start order).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

from services.launch.children import Child
from services.launch.config import LaunchConfig, with_demo_adapters
from services.mesh.etcd_member import etcd_binary
from services.launch.plan import plan_children
from services.mesh.flags import die
from services.tools.make_demo_model import ensure_demo_model

# A child imports its engine before it checks (vLLM takes a while on a busy machine).
CHECK_TIMEOUT_S = 120.0
# With an embedded etcd the children learn its address only once it runs. A child checking
# its flags connects to nothing, so any well-formed URL stands in; an unreachable one, so that
# a child that did start for real would fail at once instead of joining some other mesh.
PLACEHOLDER_ETCD = "http://127.0.0.1:1"


def check_mesh(cfg: LaunchConfig) -> None:
    """Exits 0 when every child accepts its command line, else 2 with one line."""
    if cfg.etcd_endpoints is None:
        try:
            etcd_binary()
        except FileNotFoundError as exc:
            die(str(exc))
    model = _model(cfg)
    with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
        cfg = with_demo_adapters(cfg)  # built silently, like the demo model
    children = plan_children(cfg, cfg.etcd_endpoints or PLACEHOLDER_ETCD, model)
    distinct = list({tuple(c.argv): c for c in children}.values())
    failure = asyncio.run(_first_failure(distinct))
    if failure is not None:
        die(failure)
    raise SystemExit(0)


def _model(cfg: LaunchConfig) -> str:
    """The model directory the children would get. The demo model is built as a run would build
    it (it is a cache, not a process), silently: a check prints nothing but its one line."""
    if cfg.model:
        return str(Path(cfg.model).resolve())
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull), contextlib.redirect_stderr(devnull):
        return str(ensure_demo_model())


async def _first_failure(children: list[Child]) -> str | None:
    # Every child at once: each spends most of its check importing its modules.
    reasons = await asyncio.gather(*(_check(child) for child in children))
    return next((r for r in reasons if r is not None), None)


async def _check(child: Child) -> str | None:
    proc = await asyncio.create_subprocess_exec(
        *child.argv, "--check-config", stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, env=child.env, start_new_session=True)
    try:
        output, _ = await asyncio.wait_for(proc.communicate(), CHECK_TIMEOUT_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        return f"{child.component}: its --check-config did not finish within {CHECK_TIMEOUT_S:.0f}s"
    if proc.returncode == 0:
        return None
    lines = [line for line in output.decode(errors="replace").splitlines() if line.strip()]
    reason = next((line for line in reversed(lines) if line.startswith("error: ")),
                  lines[-1] if lines else f"exit status {proc.returncode}")
    return f"{child.component}: {reason.removeprefix('error: ')}"
