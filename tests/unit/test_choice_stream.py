"""A choice taken over from a failed processor: its resumed tokens are not sent again, and a
choice whose every token was already out finishes without a worker."""

from __future__ import annotations

import pytest

from gen.kvmesh.v1 import common_pb2, processor_pb2
from services.mesh.channels import ChannelPool
from services.mesh.session_client import SessionPool
from services.routing.router_client import RouteChoice
from services.processor.choice_stream import (
    ChoiceContext,
    ChoiceLimits,
    ChoiceSpec,
    ChoiceStream,
    Delta,
    Finished,
    Started,
)
from services.processor.tokenizer import ModelTokenizer
from services.processor.validation import check_resume
from services.processor.prompt_errors import PromptError
from services.tools.make_demo_model import ensure_demo_model

ROUTE = RouteChoice("w1", "127.0.0.1:1", 0, 0.0, 0)


async def never_routes(rid: str, tokens: list[int], tried: list[str]) -> RouteChoice:
    raise AssertionError("no worker is needed")


async def test_a_choice_resumed_with_all_its_tokens_finishes_without_a_worker() -> None:
    tokenizer = ModelTokenizer(str(ensure_demo_model()))
    resumed = tokenizer.encode_text("every token was already sent")[:6]
    channels = ChannelPool()
    choice = ChoiceStream(
        spec=ChoiceSpec("r", 0, [5, 6, 7], common_pb2.SamplingParams(max_tokens=len(resumed)), []),
        ctx=ChoiceContext(tokenizer, SessionPool(channels), ChoiceLimits(10, 3, 3), never_routes, lambda w: None,
                          lambda: None))
    items = [item async for item in choice.run(ROUTE, resumed)]
    await channels.close()
    assert isinstance(items[0], Started)
    (delta,) = [i.response.delta for i in items if isinstance(i, Delta)]
    assert delta.finish_reason == common_pb2.FINISH_REASON_LENGTH and list(delta.token_ids) == []
    # Only text held back when the processor failed (a split character) may come now, never
    # text of the resumed tokens the client already has.
    assert len(delta.text) <= 1
    assert isinstance(items[-1], Finished) and items[-1].completion_tokens == len(resumed)


@pytest.mark.parametrize("resume, ok", [
    ([(0, [1, 2])], True),
    ([(0, []), (1, [3])], True),
    ([(2, [1])], False),          # outside choices 0..1
    ([(0, [1]), (0, [2])], False),  # the same choice twice
    ([(1, [1] * 5)], False),      # more tokens than max_tokens
])
def test_a_takeover_names_each_of_its_choices_once_within_bounds(resume: list[tuple[int, list[int]]], ok: bool) -> None:
    request = processor_pb2.GenerateRequest(n=2, sampling=common_pb2.SamplingParams(max_tokens=4))
    request.resume.extend(processor_pb2.ResumedChoice(index=i, token_ids=t) for i, t in resume)
    if ok:
        check_resume(request)
    else:
        with pytest.raises(PromptError):
            check_resume(request)
