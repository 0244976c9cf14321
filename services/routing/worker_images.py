"""A worker's encoder cache as a router sees it (encoder_credit.py weighs it): the images the
worker last reported keeping, and, for a short while, those of the prompts this router sent it
since, so a screenshot resent at once finds the worker about to hold its features.

A sent image counts for `SENT_GRACE_S` only: long enough for the worker to encode it (or take it
from an encode worker) and report so, short enough that a worker that never does (a decode worker
whose prompts are prefilled elsewhere, an image whose tokens were all in cached blocks) is not
credited with it for long. At most `MAX_SENT` sent images are remembered, the oldest dropped.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from gen.kvmesh.v1 import worker_pb2

SENT_GRACE_S = 2.0
MAX_SENT = 256


@dataclass(slots=True)
class WorkerImages:
    # What the worker last reported; None: it reports no encoder cache (vLLM), and nothing is credited.
    reported: frozenset[int] | None = None
    # Digest -> when this router last sent a prompt with it there.
    sent: OrderedDict[int, float] = field(default_factory=OrderedDict)
    clock: Callable[[], float] = time.monotonic

    def observe(self, load: worker_pb2.LoadMetrics) -> None:
        if load.HasField("encoder_cache"):  # unset: as last reported
            self.reported = frozenset(load.encoder_cache.digests)

    def routed(self, digests: Iterable[int]) -> None:
        """A prompt with these images was sent to the worker."""
        if self.reported is None:
            return
        now = self.clock()
        for digest in digests:
            self.sent[digest] = now
            self.sent.move_to_end(digest)
        while len(self.sent) > MAX_SENT:
            self.sent.popitem(last=False)

    @property
    def reports(self) -> bool:
        return self.reported is not None

    def keeps(self, digest: int) -> bool:
        if self.reported is None:
            return False
        if digest in self.reported:
            return True
        at = self.sent.get(digest)
        return at is not None and self.clock() - at < SENT_GRACE_S
