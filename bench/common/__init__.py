"""What the benchmarks share: the streaming HTTP client, the launched mesh and the tables, plots and JSON they report."""
