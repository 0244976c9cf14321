"""The test kit: what the tests (tests/) and the benchmarks and drills (bench/) use to start and
read a mesh from outside, in one place. Nothing in services/ imports it.

- proc.py: `Proc`, the one child-process type (output kept in memory or in a log file; blocking
  and event-loop waits), and `ProcFailed`;
- proc_stat.py: a process as /proc shows it (state, CPU, context switches, listening ports);
- etcd.py: `Etcd`, the one etcd starter: one member or a cluster, plain or mutual TLS, with
  outages (`halt` / `resume`);
- mesh.py: the mesh starters (`LaunchedMesh`, `launched_mesh`; `service_argv` and `READY` for a
  mesh started service by service) and what etcd lists (`registered`, `instances`);
- sse.py: the one SSE client (`stream`, `stream_sync`: text, finish, usage, TTFT, gaps);
- metrics.py: the one reader of Prometheus metrics.
"""
