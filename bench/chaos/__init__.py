"""make chaos: streaming load on a disaggregated mocker mesh while its processes are killed (python -m bench.chaos)."""
