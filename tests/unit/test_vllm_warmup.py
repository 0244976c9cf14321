"""The vLLM warm-up's plan and order, against a recording stand-in for the engine's request path
(the real engine runs it in tests/e2e/test_vllm_fresh_worker.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.engines.base import EngineOutput, EngineRequest, FinishReason
from services.engines.vllm_warmup import SMALLEST_PROMPTS, WarmUpPlan, warm_up, warmup_tokens

VOCAB = 2048


class Recorder:
    """Answers every request with its max_tokens tokens and records what happened, in order."""

    def __init__(self, resets_refused: int = 0, tokens: bool = True) -> None:
        self.log: list[tuple[str, ...]] = []
        self.requests: list[EngineRequest] = []
        self._refusals = resets_refused
        self._tokens = tokens

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        self.requests.append(request)
        self.log.append(("start", str(len(request.token_ids))))
        await asyncio.sleep(0)  # let a phase's other requests start: they run together
        n = request.sampling.max_tokens if self._tokens else 0
        self.log.append(("end", str(len(request.token_ids))))
        yield EngineOutput(token_ids=[1] * n, finish_reason=FinishReason.LENGTH)

    async def reset(self) -> bool:
        self.log.append(("reset",))
        if self._refusals:
            self._refusals -= 1
            return False
        return True


def test_the_first_prompt_is_two_blocks_long_and_the_smallest_follow() -> None:
    plan = WarmUpPlan.for_engine(block_size=32, max_model_len=4096)
    assert plan.long_prompt == 64
    assert plan.small_prompts == SMALLEST_PROMPTS == (1, 2)


def test_a_short_context_caps_the_long_prompt_with_room_for_the_output() -> None:
    assert WarmUpPlan.for_engine(block_size=32, max_model_len=40).long_prompt == 38


def test_a_long_prompt_no_longer_than_the_small_ones_is_refused() -> None:
    with pytest.raises(ValueError, match="long_prompt"):
        WarmUpPlan(long_prompt=2)


def test_warmup_prompts_stay_in_the_vocabulary_and_share_no_first_token() -> None:
    prompts = [warmup_tokens(64, VOCAB, offset=i) for i in range(3)]
    assert all(0 <= t < VOCAB for p in prompts for t in p)
    assert len({p[0] for p in prompts}) == 3


async def test_the_long_prompt_runs_alone_then_the_cache_is_reset_then_the_small_ones_run_together() -> None:
    engine = Recorder()
    await warm_up(engine.generate, engine.reset, WarmUpPlan(long_prompt=64), VOCAB)
    assert engine.log == [
        ("start", "64"), ("end", "64"),
        ("reset",),
        ("start", "1"), ("start", "2"), ("end", "1"), ("end", "2"),
    ]
    assert all(r.request_id.startswith("warmup-") for r in engine.requests)
    assert all(r.sampling.max_tokens >= 2 and r.sampling.ignore_eos for r in engine.requests)


async def test_a_refused_reset_is_tried_again() -> None:
    engine = Recorder(resets_refused=2)
    await warm_up(engine.generate, engine.reset, WarmUpPlan(long_prompt=64), VOCAB)
    assert engine.log.count(("reset",)) == 3


async def test_an_engine_that_produces_nothing_fails_the_warmup() -> None:
    engine = Recorder(tokens=False)
    with pytest.raises(RuntimeError, match="64-token prompt produced no token"):
        await warm_up(engine.generate, engine.reset, WarmUpPlan(long_prompt=64), VOCAB)
