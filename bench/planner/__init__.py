"""The planner against every fixed prefill:decode split on a workload whose needs change (make bench ARGS="--only planner")."""
