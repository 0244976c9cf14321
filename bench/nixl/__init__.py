"""NIXL transfer throughput against memcpy (make bench ARGS="--only nixl")."""
