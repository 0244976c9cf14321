"""The LoRA placement workload: 32 adapters of Zipf popularity, each with its own system prompt.

Every request names one adapter (drawn from Zipf(s) over the adapters' ranks, adapter 0 the hottest) and sends
that adapter's system prefix followed by a user part of its own, for a few output tokens (run.py's two workloads:
a long prefix with a short user part, and a short prefix with a long user part); requests arrive
open-loop (Poisson). A seed fixes the adapter draws, the user parts and the arrival gaps, so the modes of one
seed see the very same requests (paired runs). The system prefixes are fixed by the adapter alone.

The adapters are PEFT-shaped directories (`adapter_config.json` and a weights file) whose weights file is sparse:
it has the size of a real adapter, which is what the mocker's load time comes from, and costs no disk.

`fewest_loads` is the floor any placement is held to: Belady's optimal eviction over one pool of all workers'
adapter slots together. Splitting the pool into workers, or holding an adapter on two of them, only adds loads.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from services.tools.make_demo_adapter import write_stand_in_adapter

# A rank-8 adapter on every linear layer of an 8B Llama (32 layers; q, k, v, o, gate, up, down: r * (in + out)
# = 81,920 * r parameters a layer) in bf16.
LLAMA_8B_LORA_PARAMS_PER_RANK = 32 * 81_920
BF16_BYTES = 2
TOKEN_LOW, TOKEN_HIGH = 10, 1000  # token ids drawn uniformly in [low, high), as the routing benchmarks do


@dataclass(frozen=True)
class LoraWorkload:
    adapters: int = 32
    zipf_s: float = 1.1
    rank: int = 8
    prefix_tokens: int = 1536  # each adapter's system prompt: 96 blocks of 16 tokens
    user_tokens: int = 64
    output_tokens: int = 16
    rate_per_s: float = 16.0
    warmup_requests: int = 120  # sent first, waited for, not counted
    requests: int = 480  # measured

    def __post_init__(self) -> None:
        if self.adapters < 2:
            raise ValueError(f"adapters must be >= 2, got {self.adapters}")
        if self.zipf_s <= 0:
            raise ValueError(f"zipf_s must be > 0, got {self.zipf_s}")
        for name in ("rank", "prefix_tokens", "user_tokens", "output_tokens", "requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_requests < 0 or not self.rate_per_s > 0:
            raise ValueError("warmup_requests must be >= 0 and rate_per_s > 0")

    @property
    def adapter_bytes(self) -> int:
        return LLAMA_8B_LORA_PARAMS_PER_RANK * self.rank * BF16_BYTES

    def names(self) -> list[str]:
        return [f"lora-{i:02d}" for i in range(self.adapters)]

    def popularity(self) -> list[float]:
        """P(adapter i) for i in rank order: proportional to (i + 1) ** -s."""
        weights = [(i + 1) ** -self.zipf_s for i in range(self.adapters)]
        total = sum(weights)
        return [w / total for w in weights]


@dataclass(frozen=True, slots=True)
class Request:
    adapter: str
    tokens: list[int]
    gap_s: float  # the wait before sending it, after the previous one was sent
    warmup: bool


def write_adapters(workload: LoraWorkload, root: Path) -> dict[str, Path]:
    """Each adapter's directory under `root` (kept between runs, the weights file sparse): name -> path."""
    return {name: write_stand_in_adapter(root / name, workload.adapter_bytes, workload.rank)
            for name in workload.names()}


def system_prefix(workload: LoraWorkload, adapter_index: int) -> list[int]:
    rng = random.Random(f"lora-prefix-{adapter_index}")
    return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(workload.prefix_tokens)]


def requests(workload: LoraWorkload, seed: int) -> list[Request]:
    """The warm-up requests, then the measured ones, all drawn from `seed`."""
    rng = random.Random(seed)
    names = workload.names()
    prefixes = [system_prefix(workload, i) for i in range(workload.adapters)]
    weights = workload.popularity()
    out = []
    for n in range(workload.warmup_requests + workload.requests):
        i = rng.choices(range(workload.adapters), weights)[0]
        user = [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(workload.user_tokens)]
        gap = rng.expovariate(workload.rate_per_s) if n else 0.0
        out.append(Request(names[i], prefixes[i] + user, gap, warmup=n < workload.warmup_requests))
    return out


def fewest_loads(sequence: Sequence[str], slots: int, counted_from: int = 0) -> int:
    """The loads Belady's optimal eviction needs for `sequence` with `slots` adapters resident at once, starting
    empty, counting those at positions >= `counted_from` (a miss evicts the adapter needed again the latest)."""
    next_use = [len(sequence)] * len(sequence)
    seen: dict[str, int] = {}
    for pos in range(len(sequence) - 1, -1, -1):
        next_use[pos] = seen.get(sequence[pos], len(sequence))
        seen[sequence[pos]] = pos
    resident: dict[str, int] = {}  # adapter -> the position it is next needed at
    loads = 0
    for pos, adapter in enumerate(sequence):
        if adapter not in resident:
            if len(resident) >= slots:
                del resident[max(resident, key=resident.__getitem__)]
            loads += pos >= counted_from
        resident[adapter] = next_use[pos]
    return loads
