"""How CPU engines that share a host share its cores.

vLLM on a CPU binds each engine's OpenMP threads to cores (`VLLM_CPU_OMP_THREADS_BIND`, default
`auto`: every core of the NUMA node). Two engines left to `auto` on one host bind to the same
cores, and each one's threads wait at their barriers for threads the other engine's threads
have preempted: both slow down far more than halving their cores would. So whoever starts
several engines on one host (the launcher, the tests' reference run) gives each its own share.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

# vLLM's variable: a comma list of cores per engine ("0,1"); "nobind" or "auto" are vLLM's own.
BIND_VARIABLE = "VLLM_CPU_OMP_THREADS_BIND"


def host_cores() -> list[int]:
    """The cores this process may run on (its affinity mask, as a container or taskset limits it)."""
    return sorted(os.sched_getaffinity(0))


def core_shares(cores: Sequence[int], engines: int) -> list[str]:
    """Each of `engines` engines' cores, as vLLM's bind variable writes them: disjoint runs of
    cores while there are at least as many cores as engines (the first ones take the remainder),
    else one core each, taken in turn (an engine's threads never wait for each other then)."""
    if engines < 1 or not cores:
        raise ValueError(f"core_shares: {engines} engines on cores {list(cores)}")
    if engines > len(cores):
        return [str(cores[i % len(cores)]) for i in range(engines)]
    size, extra = divmod(len(cores), engines)
    shares, start = [], 0
    for i in range(engines):
        end = start + size + (1 if i < extra else 0)
        shares.append(",".join(map(str, cores[start:end])))
        start = end
    return shares


def bind_env(share: str) -> dict[str, str]:
    """The environment that binds one engine to its share, unless the operator bound engines
    themselves (their setting wins)."""
    return {} if BIND_VARIABLE in os.environ else {BIND_VARIABLE: share}
