"""When each child serves, and when the whole mesh does.

A child is ready when it says so: workers print `<component> ready: <instance ids>` once every
instance is registered; the router, the processor and the frontend log a line once registered
(matched below; these are INFO lines, so with `--log-level WARNING` they are not written and the
child is taken as ready when the mesh is). The mesh is ready when every worker is and the
frontend's `/health` answers 200 (it needs a router, a processor and a decode worker registered).
"""

from __future__ import annotations

import asyncio
import re

import httpx

from services.launch.children import Child

HEALTH_POLL_S = 0.25

# Matched against each output line's message (the `msg` of a JSON log line).
_READY_LINES = {
    "kv-router": r"\brouter \w+ \(\S+ mode\) at ",
    "processor": r"\bprocessor \w+ for \S+ at ",
    "frontend": r"\bfrontend \w+ listening on ",
    "planner": r"\bplanner \w+ planning with ",
}


def ready_pattern(component: str) -> re.Pattern[str]:
    """What `component` prints or logs once it serves; `<component> ready: ...` always counts."""
    own = re.escape(component) + " ready: "
    return re.compile(f"^{own}|{_READY_LINES[component]}" if component in _READY_LINES else f"^{own}")


async def wait_ready(health_url: str, children: list[Child], timeout_s: float) -> None:
    """Returns once the mesh serves; every child not seen ready by then is marked ready.
    Raises RuntimeError when a child exits first, TimeoutError after `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    reason = "no answer yet"
    async with httpx.AsyncClient(timeout=2.0) as client:
        while loop.time() < deadline:
            for child in children:
                if child.returncode is not None:
                    where = f" (its log: {child.log_path})" if child.log_path else ""
                    raise RuntimeError(
                        f"{child.component} exited with code {child.returncode} during start-up{where}; "
                        "its last lines:\n  " + "\n  ".join(child.tail))
            waiting_for = [c.component for c in children if c.ready_required and not c.ready]
            if waiting_for:
                reason = "waiting for " + ", ".join(sorted(set(waiting_for)))
                await asyncio.sleep(HEALTH_POLL_S)
                continue
            try:
                reply = await client.get(health_url)
                if reply.status_code == 200:
                    for child in children:
                        child.mark_ready()
                    return
                reason = reply.json().get("reason", reply.text)
            except (httpx.HTTPError, ValueError) as exc:
                reason = type(exc).__name__
            await asyncio.sleep(HEALTH_POLL_S)
    raise TimeoutError(f"the mesh was not healthy within {timeout_s:.0f}s: {reason}")
