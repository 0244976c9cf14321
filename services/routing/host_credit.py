"""What a prefix block held in a worker's host memory is worth against one on its device.

A device hit saves recomputing the block; a host hit saves the same recomputation but must first
load the block back over the host link. So, for the host-resident blocks of a prompt, which sit
at token positions [start, end) after the device-held prefix:

    credit = max(0, (prefill_time(start, end) - load_time) / prefill_time(start, end))

where prefill_time comes from the worker's reported prefill cost (per token, growing with the
context before it: later blocks cost more to recompute, so a long host-held prefix earns more per
block than a short one) and load_time = tokens x KV bytes per token / the link's bandwidth. The
cost function counts each host block as `credit` of a device block. A slow link or a small model
(cheap to recompute) pushes the credit towards 0; a fast link and a large model towards 1.

A worker that reports no prefill cost or host link (vLLM today) gets FALLBACK_CREDIT;
`--host-overlap-weight W` replaces the derived credit with W everywhere (W = 0 ignores the host
tier; 0.75 is NVIDIA Dynamo's fixed weight).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping

from gen.kvmesh.v1 import worker_pb2
from services.kv_protocol.tier import prefill_seconds
from services.routing.worker_pool import WorkerState

# A host hit when the worker cannot say what recomputing costs: NVIDIA Dynamo's fixed weight.
FALLBACK_CREDIT = 0.75


def host_credit(load: worker_pb2.LoadMetrics, device_blocks: int, host_blocks: int, block_size: int,
                fixed_weight: float | None = None) -> float:
    """The credit per host-held block for a prompt whose first `device_blocks` are on the device
    and next `host_blocks` in host memory."""
    if fixed_weight is not None:
        return fixed_weight
    if host_blocks <= 0:
        return 0.0
    if not load.HasField("prefill_cost") or not load.HasField("host_tier") or load.host_tier.load_gbps <= 0:
        return FALLBACK_CREDIT
    start, end = device_blocks * block_size, (device_blocks + host_blocks) * block_size
    saved_s = prefill_seconds(load.prefill_cost.us_per_token, load.prefill_cost.us_per_token_per_1k, start, end)
    if saved_s <= 0:
        return 0.0
    load_s = (end - start) * load.host_tier.kv_bytes_per_token / (load.host_tier.load_gbps * 1e9)
    return max(0.0, (saved_s - load_s) / saved_s)


def host_credits(workers: Iterable[WorkerState], device: Mapping[Hashable, int], host: Mapping[Hashable, int],
                 block_size: int, fixed_weight: float | None = None) -> dict[str, float]:
    """Per worker holding some of the prompt's blocks in host memory only, the credit of each: the
    one place a decision works it out (its pick, explanation and prefix hit rate read this)."""
    out: dict[str, float] = {}
    if not host:
        return out  # no host tier anywhere (the common case): nothing to weigh
    for worker in workers:
        wid = worker.info.instance_id
        if held := host.get(wid, 0):
            out[wid] = host_credit(worker.load, device.get(wid, 0), held, block_size, fixed_weight)
    return out
