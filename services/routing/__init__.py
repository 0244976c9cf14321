"""The router's core, a library: the KV index of every worker's cached blocks (radix_tree.py), the
cost function and host credit, one picker per router mode, the worker pool fed by KV events and
load, and the Router servicer over them. The kv_router service serves it over gRPC; a processor
with `--routing local` embeds the same pieces in-process."""
