"""How CPU engines that share a host share its cores.

vLLM on a CPU binds each engine's OpenMP threads to cores (`VLLM_CPU_OMP_THREADS_BIND`, default
`auto`: one logical CPU of every physical core of the first NUMA node). Two engines left to `auto`
on one host bind to the same cores, and each one's threads wait at their barriers for threads the
other engine has preempted: both slow down far more than halving their cores would. So whoever
starts several engines on one host (the launcher, the tests' reference run) gives each its own
physical cores, one logical CPU of each, as `auto` would.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

# vLLM's variable: a comma list of logical CPUs per engine ("0,1"); "nobind" or "auto" are vLLM's own.
BIND_VARIABLE = "VLLM_CPU_OMP_THREADS_BIND"
_TOPOLOGY = Path("/sys/devices/system/cpu")


def _sysfs_core(cpu: int) -> tuple[int, int] | None:
    """(package, core) of a logical CPU as Linux numbers them, None where sysfs does not say."""
    try:
        topology = _TOPOLOGY / f"cpu{cpu}" / "topology"
        return int((topology / "physical_package_id").read_text()), int((topology / "core_id").read_text())
    except (OSError, ValueError):
        return None


def host_cores(core_of: Callable[[int], tuple[int, int] | None] = _sysfs_core) -> list[int]:
    """One logical CPU (the lowest) of each physical core this process may run on (its affinity
    mask, as a container or taskset limits it): hyperthread siblings share a core's units, so
    two engines on two siblings of one core would contend as on one core."""
    first: dict[object, int] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        first.setdefault(core_of(cpu) or ("cpu", cpu), cpu)
    return sorted(first.values())


def core_shares(cores: Sequence[int], engines: int) -> list[str]:
    """Each of `engines` engines' CPUs, as vLLM's bind variable writes them: disjoint runs of
    `cores` (one CPU per physical core, see host_cores) while there are at least as many as
    engines (the first ones take the remainder), else one each, taken in turn (an engine's
    threads never wait for each other then)."""
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
