"""A prompt as the processor hands it on: its tokens, and the images some of them stand for."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gen.kvmesh.v1 import common_pb2


@dataclass(frozen=True, slots=True)
class Prompt:
    tokens: list[int]
    # Its images, in prompt order, each with the span of placeholder tokens it fills (images.py).
    media: Sequence[common_pb2.MediaItem] = ()

    def spans(self) -> list[common_pb2.MediaSpan]:
        """Where its images stand: what routing hashes the blocks with."""
        return [item.span for item in self.media]
