"""make bench ARGS="--only routing": how well the router places requests, in parts.

- modes.py: kv against round-robin and random on a prefix-heavy workload.
- cost_models.py: kv mode's cached-share cost rule against NVIDIA Dynamo's, on the Mooncake trace and shared prefixes.
- kv_events.py (measured) and kv_events_report.py: KV events on, off, and a worker whose events go silent,
  against Dynamo with and without events.
"""

from __future__ import annotations

from bench.routing import cost_models, kv_events_report, modes


def run() -> dict:
    return {"modes": modes.run(), "cost_models": cost_models.run(),
            "kv_events": kv_events_report.run()}
