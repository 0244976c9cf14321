"""The KV index against a naive index on a synthetic trace (make bench ARGS="--only indexer")."""
