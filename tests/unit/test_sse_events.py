"""A streamed answer's events are OpenAI's chunks byte for byte, whether a delta takes the text
template (plain text) or is built as a dict (role, finish, logprobs, reasoning, tool calls)."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest

from gen.kvmesh.v1 import common_pb2, processor_pb2
from services.frontend.answer import Answer
from services.frontend.endpoints import CHAT, COMPLETION, Kind
from services.frontend.inflight import InflightLimit
from services.frontend.metrics import FrontendMetrics
from services.frontend.responses import TextEvents, finish_name, sse

TEXTS = ["", "plain", 'quotes " and \\ backslash', "tab\tnewline\ncontrol\x01\x00", "café 你好 🙂", "\ufffd", "</s>"]


class Deltas:
    """A processor stream that has already answered: its deltas, then the usage."""

    def __init__(self, deltas: list[processor_pb2.ChoiceDelta]) -> None:
        self._deltas = deltas

    async def messages(self) -> AsyncIterator[processor_pb2.GenerateResponse]:
        for d in self._deltas:
            yield processor_pb2.GenerateResponse(delta=d)
        yield processor_pb2.GenerateResponse(usage=processor_pb2.Usage(prompt_tokens=3, completion_tokens=4))

    def cancel(self) -> None:
        pass


async def streamed(kind: Kind, include_usage: bool, deltas: list[processor_pb2.ChoiceDelta]) -> list[bytes]:
    metrics = FrontendMetrics()
    lease = InflightLimit(10, metrics.inflight).acquire(1)
    req = SimpleNamespace(model="kvmesh-demo", include_usage=include_usage, logprobs=None)
    answer = Answer(metrics, kind, req, "r1", [Deltas(deltas)], 0.0, lease)  # type: ignore[list-item]
    return [event async for event in answer.sse()]


def expected_chunk(kind: Kind, include_usage: bool, choice: dict) -> dict:
    body = {"id": kind.id_prefix + "r1", "object": kind.chunk_name, "created": None, "model": "kvmesh-demo",
            "choices": [choice]}
    if include_usage:
        body["usage"] = None
    return body


@pytest.mark.parametrize("kind", [CHAT, COMPLETION], ids=["chat", "completions"])
@pytest.mark.parametrize("include_usage", [False, True])
async def test_text_events_are_the_chunks_byte_for_byte(kind: Kind, include_usage: bool) -> None:
    rng = random.Random(3)
    texts = TEXTS + ["".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x3000)]))
                             for _ in range(rng.randint(0, 12))) for _ in range(50)]
    deltas = [processor_pb2.ChoiceDelta(index=i % 2, text=t) for i, t in enumerate(texts)]
    deltas += [processor_pb2.ChoiceDelta(index=0, text="end", finish_reason=common_pb2.FINISH_REASON_STOP),
               processor_pb2.ChoiceDelta(index=1, text="", finish_reason=common_pb2.FINISH_REASON_LENGTH)]
    events = await streamed(kind, include_usage, deltas)
    shown = [d for d in deltas if d.text or d.finish_reason]  # an empty delta is a character still forming
    opened: set[int] = set()
    expected = []
    for d in shown:
        if kind is CHAT:
            delta = {"content": d.text}
            if d.index not in opened:
                opened.add(d.index)
                delta["role"] = "assistant"
            choice = {"index": d.index, "delta": delta, "logprobs": None, "finish_reason": finish_name(d.finish_reason)}
        else:
            choice = {"index": d.index, "text": d.text, "finish_reason": finish_name(d.finish_reason), "logprobs": None}
        expected.append(expected_chunk(kind, include_usage, choice))
    assert len(events) == len(shown) + include_usage + 1
    for event, body in zip(events, expected):
        # `created` is the answer's clock: taken from the event, everything else must match exactly.
        body["created"] = int(event.split(b'"created":')[1].split(b",")[0])
        assert event == sse(body)
    assert events[-1] == b"data: [DONE]\n\n"


def test_a_template_whose_chunk_lacks_the_text_is_refused() -> None:
    with pytest.raises(ValueError, match="exactly once"):
        TextEvents(lambda index, text: {"index": index}).event(0, "x")
