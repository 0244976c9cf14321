"""CPU accounting for the planner benchmark: the share of the machine in use during a replay."""

from __future__ import annotations


def machine_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine since boot, summed over its CPUs."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


class CpuMeter:
    """Share of the machine's CPU in use between `start` and `stop`."""

    def __init__(self) -> None:
        self._start = (0, 0)

    def start(self) -> None:
        self._start = machine_ticks()

    def stop(self) -> float:
        busy, total = machine_ticks()
        return (busy - self._start[0]) / max(1, total - self._start[1])
