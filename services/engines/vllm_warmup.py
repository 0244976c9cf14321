"""A vLLM engine's warm-up: the forward passes that make its first real request safe, run inside
`VllmEngine.start`, so before the worker registers in etcd and prints its ready line.

Why it is needed. On CPU, kvmesh runs vLLM eagerly with an explicit KV cache size, and vLLM then
runs no forward pass at start-up: the first request is the engine's first forward pass. On an x86
CPU with AMX tiles (Intel Sapphire Rapids and later; vLLM loads its `vllm._C` kernels wherever
AVX-512 BF16 is present), vLLM's bfloat16 attention kernel executes AMX tile instructions but never
asks Linux for the right to (`arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)`); without it the first
tile instruction is an illegal instruction, the engine's worker process dies without a traceback
and the engine core reports `RuntimeError: cancelled`. oneDNN does ask, the first time it builds an
AMX kernel: vLLM's linear layers reach oneDNN (through PyTorch's `cpublas::brgemm`) only when they
multiply more than a few rows, and use a small-batch kernel with AVX-512 BF16 instructions alone
below that. So a first prompt of 2-3 tokens kills a fresh engine, and a first prompt of 8 tokens
makes every later one safe: the permission holds for the process's life.

The plan, in order:
1. one prompt of two KV blocks: many rows (the permission), full blocks and a cache write;
2. the prefix cache is reset, so the warm-up leaves no block behind to be routed to;
3. the smallest shapes a worker sees: a 1-token and a 2-token prompt together (a batch of two,
   then one). They fill no block, and their engine steps publish the reset's `AllBlocksCleared`
   event ahead of any real request's events, so a router never indexes a warm-up block for long.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from services.engines.base import EngineOutput, EngineRequest, Sampling

log = logging.getLogger(__name__)

# The smallest prompts a worker is sent (a 1-token completion prompt, a cached prompt's remainder).
SMALLEST_PROMPTS = (1, 2)
# Output tokens per warm-up prompt: at least one decode step after the prefill.
WARMUP_OUTPUT_TOKENS = 2
# A reset refused because the warm-up's blocks are still held is retried for this long.
RESET_DEADLINE_S = 10.0


@dataclass(frozen=True)
class WarmUpPlan:
    """The prompt lengths of each warm-up phase; each phase's prompts run together."""

    long_prompt: int
    small_prompts: tuple[int, ...] = SMALLEST_PROMPTS

    def __post_init__(self) -> None:
        if self.long_prompt <= max(self.small_prompts):
            raise ValueError(f"WarmUpPlan.long_prompt: {self.long_prompt} tokens is not longer than the small prompts")

    @classmethod
    def for_engine(cls, block_size: int, max_model_len: int) -> WarmUpPlan:
        """Two blocks, or as much as the context allows with room for the output."""
        return cls(long_prompt=min(2 * block_size, max_model_len - WARMUP_OUTPUT_TOKENS))


def warmup_tokens(length: int, vocab_size: int, offset: int = 0) -> list[int]:
    """A prompt of `length` token ids spread over the vocabulary (any ids will do: the model's
    output is thrown away); `offset` keeps two prompts of one phase from sharing a prefix."""
    return [(offset + 7919 * i + 13) % vocab_size for i in range(length)]


Generate = Callable[[EngineRequest], AsyncIterator[EngineOutput]]


async def warm_up(generate: Generate, reset_prefix_cache: Callable[[], Awaitable[bool]], plan: WarmUpPlan,
                  vocab_size: int) -> float:
    """Runs the plan through `generate` (the engine's own request path); returns the seconds it
    took. An engine that cannot run it raises here, before its worker registers."""
    started = time.monotonic()
    await _run_phase(generate, (plan.long_prompt,), vocab_size, "long")
    await _reset(reset_prefix_cache)
    await _run_phase(generate, plan.small_prompts, vocab_size, "small")
    return time.monotonic() - started


async def _run_phase(generate: Generate, lengths: tuple[int, ...], vocab_size: int, name: str) -> None:
    sampling = Sampling(max_tokens=WARMUP_OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)

    async def one(i: int, length: int) -> None:
        request = EngineRequest(f"warmup-{name}-{i}", warmup_tokens(length, vocab_size, offset=i), sampling)
        produced = 0
        async for out in generate(request):
            produced += len(out.token_ids)
        if produced == 0:
            raise RuntimeError(f"vLLM warm-up: a {length}-token prompt produced no token")

    await asyncio.gather(*(one(i, length) for i, length in enumerate(lengths)))


async def _reset(reset_prefix_cache: Callable[[], Awaitable[bool]]) -> None:
    """vLLM refuses a reset while any block is still held; the warm-up's are freed as its requests
    finish, so a refusal is retried briefly."""
    deadline = time.monotonic() + RESET_DEADLINE_S
    while not await reset_prefix_cache():
        if time.monotonic() > deadline:
            log.warning("vLLM warm-up: the prefix cache could not be reset within %.0f s; "
                        "the warm-up's blocks stay cached until evicted", RESET_DEADLINE_S)
            return
        await asyncio.sleep(0.05)
