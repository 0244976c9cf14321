"""make bench ARGS="--only agents": agent sessions whose KV survives the tool call, against plain kv routing.

- workload.py: the trace (sessions that resend their growing history after a tool gap, and unrelated
  background prompts), seeded, and the reuse any prefix cache could reach on it.
- drive.py: the client that plays one run's trace against a mesh and keeps what each response says.
- run_figures.py: one run's figures; mesh_counters.py: the workers' host hits and session pins, the
  router's session routes, from their /metrics.
- run.py: the mesh, the modes and seeds, the JSON; record.py: one run's record (`Run`); report.py: the tables and
  goals line; plot.py: the PNG.
"""
