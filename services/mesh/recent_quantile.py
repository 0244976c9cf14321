"""A quantile of the last few hundred samples of something, taken again every few samples (a
sort of 256 floats costs microseconds; per sample it would be most of a request's admission)."""

from __future__ import annotations

from collections import deque


class RecentQuantile:
    def __init__(self, quantile: float, samples: int = 256, every: int = 32) -> None:
        if not 0 <= quantile <= 1 or samples < 1 or every < 1:
            raise ValueError("a quantile within 0..1, and at least one sample")
        self._quantile = quantile
        self._samples: deque[float] = deque(maxlen=samples)
        self._every = every
        self._count = 0
        # The quantile as last taken (0 before any sample).
        self.value = 0.0

    def observe(self, sample: float) -> None:
        self._samples.append(sample)
        self._count += 1
        # Every sample while there are few: the first ones set the value at once.
        if self._count < self._every or self._count % self._every == 0:
            ordered = sorted(self._samples)
            self.value = ordered[min(len(ordered) - 1, int(len(ordered) * self._quantile))]
