"""make bench ARGS="--only lora": where LoRA requests are placed, adapter-aware against adapter-blind routing.

- workload.py: the adapters (PEFT-shaped directories on disk), their Zipf popularity, the prompts and arrivals,
  and the fewest adapter loads any placement could do on the same requests.
- drive.py: the open-loop client that sends one run's requests and collects what each response says.
- adapter_metrics.py: the workers' LoRA counters and residency, scraped from their /metrics.
- run.py: the two workloads (long and short per-adapter prefix), the mesh of each (workload, seed, mode) run and
  the JSON; record.py: a workload (`Case`) and one run's record (`Run`); report.py: each workload's tables and
  goals line; plot.py: the PNG, one row per workload.
"""
