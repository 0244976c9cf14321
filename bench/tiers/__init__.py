"""KV tiers on a public conversation trace, and the index's memory with both tiers held (make bench ARGS="--only tiers")."""
