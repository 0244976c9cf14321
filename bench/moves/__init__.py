"""make bench ARGS="--only moves": rolling restarts of the decode pool under long-context load, a
drained worker's requests handed over with their KV against recompute, waiting, and Dynamo."""
