"""What the routing benchmarks count of their requests (`ReuseTally`). The client itself is the
test kit's (testkit/sse.py: `stream_completion`, `Streamed`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from testkit.sse import Streamed


@dataclass
class ReuseTally:
    """What the routing benchmarks count of their requests: TTFT, prompt and cached tokens."""

    ttft_ms: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    failures: int = 0

    @property
    def hit_rate(self) -> float:
        """The share of prompt tokens the workers reused (cached_tokens over prompt tokens)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def add(self, outcome: Streamed) -> bool:
        """Counts one request; False (a failure) when it did not complete."""
        if not outcome.ok:
            self.failures += 1
            return False
        self.ttft_ms.append(outcome.ttft_s * 1000)
        self.prompt_tokens += outcome.prompt_tokens
        self.cached_tokens += outcome.cached_tokens
        return True
