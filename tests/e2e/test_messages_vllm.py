"""Anthropic's Messages API on vLLM with the demo model and the official client: a forced tool call
is constrained by the engine to the tool's input schema (so even random weights give a valid
input), whole and streamed alike, and its result goes back in the next turn."""

from __future__ import annotations

import jsonschema
import anthropic
import pytest

from tests.e2e.test_agents_vllm import CITY_ENUM
from tests.procs import MODEL, Mesh

pytestmark = pytest.mark.vllm
TOOL = {"name": "get_weather", "description": "the weather in a city", "input_schema": CITY_ENUM}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Greedy: the streamed answer is the whole one. (This client version has no `temperature`
# argument any more; the API still takes the field.)
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def client(vllm_mesh: Mesh) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=vllm_mesh.base_url.removesuffix("/v1"), api_key="unused", max_retries=0,
                               timeout=120)


@pytest.mark.parametrize("tool_choice", [{"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                                         {"type": "any", "disable_parallel_tool_use": True}], ids=["tool", "any"])
def test_a_forced_tool_call_fits_its_schema_whole_and_streamed(client: anthropic.Anthropic, tool_choice: dict) -> None:
    kwargs = dict(model=MODEL, max_tokens=60, messages=ASK, tools=[TOOL], tool_choice=tool_choice, **GREEDY)
    whole = client.messages.create(**kwargs)
    assert whole.stop_reason == "tool_use", whole
    calls = [b for b in whole.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather", whole.content
    jsonschema.validate(calls[0].input, CITY_ENUM)
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(calls[0].name, calls[0].input)]


def test_a_tool_result_goes_back_under_the_calls_id_and_count_tokens_counts_the_turn(client: anthropic.Anthropic
                                                                                    ) -> None:
    first = client.messages.create(model=MODEL, max_tokens=60, messages=ASK, tools=[TOOL],
                                   tool_choice={"type": "tool", "name": "get_weather"}, **GREEDY)
    [call] = [b for b in first.content if b.type == "tool_use"]
    history = ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                   "content": [{"type": "text", "text": "21 C, sunny"}]}]}]
    second = client.messages.create(model=MODEL, max_tokens=8, messages=history, tools=[TOOL],
                                    tool_choice={"type": "none"}, **GREEDY)
    assert second.stop_reason in ("end_turn", "max_tokens") and second.content[0].type == "text"
    counted = client.messages.count_tokens(model=MODEL, messages=history, tools=[TOOL], tool_choice={"type": "none"})
    assert counted.input_tokens == second.usage.input_tokens + (second.usage.cache_read_input_tokens or 0)
    assert counted.input_tokens > first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
