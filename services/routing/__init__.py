"""The router's core, a library: the KV index of every worker's cached blocks (radix_tree.py), the
cost function and host credit, one picker per router mode, the worker pool fed by KV events and
load, admission, and the `Router` (router.py) that decides over them on plain values
(route_query.py), with its config and flags. The kv_router service serves it over gRPC
(servicer.py, wire.py); a processor with `--routing local` calls the same `Router` in-process."""
