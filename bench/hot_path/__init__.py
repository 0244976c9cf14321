"""The streaming hot path against NVIDIA Dynamo (make bench ARGS="--only hot-path")."""
