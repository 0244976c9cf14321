"""A streaming OpenAI-completions client for the benchmarks: TTFT, gaps between chunks, usage."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class StreamResult:
    ok: bool
    ttft_s: float = float("nan")
    gaps_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    worker: str = ""
    prefill: str = ""

    @property
    def mean_itl_s(self) -> float:
        return sum(self.gaps_s) / len(self.gaps_s) if self.gaps_s else 0.0


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

    def add(self, outcome: StreamResult) -> bool:
        """Counts one request; False (a failure) when it did not complete."""
        if not outcome.ok:
            self.failures += 1
            return False
        self.ttft_ms.append(outcome.ttft_s * 1000)
        self.prompt_tokens += outcome.prompt_tokens
        self.cached_tokens += outcome.cached_tokens
        return True


async def stream_completion(session: aiohttp.ClientSession, tokens: list[int], max_tokens: int,
                            model: str = "kvmesh-demo") -> StreamResult:
    body = {"model": model, "prompt": tokens, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    started = time.perf_counter()
    result = StreamResult(ok=False)
    last = None
    async with session.post("/v1/completions", json=body) as r:
        if r.status != 200:
            await r.read()
            return result
        result.worker = r.headers.get("x-kvmesh-worker", "")
        result.prefill = r.headers.get("x-kvmesh-prefill", "")
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if chunk.get("choices"):
                if last is None:
                    result.ttft_s = now - started
                else:
                    result.gaps_s.append(now - last)
                last = now
            if chunk.get("usage"):
                result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                result.cached_tokens = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
                result.ok = True
    return result
