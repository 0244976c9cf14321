"""A gateway that falls behind a stream sends the text rows already waiting together with the
one it sends (fewer, larger writes), byte for byte the events it would have sent one by one, and
keeps every row's tokens for a takeover.

Logic only: the processor's call is a real SessionStream fed by hand, as its session's reader
would feed it."""

from __future__ import annotations

import asyncio
import time

from gen.kvmesh.v1 import common_pb2, processor_pb2
from services.frontend.answer import Answer
from services.frontend.endpoints import CHAT, COMPLETION, Kind
from services.frontend.inflight import InflightLimit
from services.frontend.metrics import FrontendMetrics
from services.frontend.processor_stream import ProcessorStream
from services.frontend.schemas import parse
from services.mesh.recent_failures import RecentFailures
from services.mesh.session_client import SessionStream
from tests.unit.stand_ins import StandInSession


def delta(text: str, ids: list[int],
          finish: common_pb2.FinishReason = common_pb2.FINISH_REASON_UNSPECIFIED) -> processor_pb2.GenerateResponse:
    return processor_pb2.GenerateResponse(delta=processor_pb2.ChoiceDelta(text=text, token_ids=ids,
                                                                          finish_reason=finish))


def answer_for(kind: Kind) -> tuple[Answer, ProcessorStream, SessionStream]:
    body = {"model": "m", "stream": True, "max_tokens": 8}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if kind is CHAT else {"prompt": "hi"}
    metrics = FrontendMetrics()
    stream = ProcessorStream(None, processor_pb2.GenerateRequest(n=1), 10, RecentFailures())  # type: ignore[arg-type]
    call = SessionStream(1, StandInSession())  # type: ignore[arg-type]
    stream._call = call
    answer = Answer(metrics, kind, parse(kind.schema, body), "r1", [stream], time.perf_counter(),
                    InflightLimit(8, metrics.inflight).acquire(1))
    answer.created = 0  # both runs' events must compare byte for byte, whatever the second
    return answer, stream, call


async def sent_events(kind: Kind, behind: bool) -> tuple[list[bytes], list[int]]:
    answer, stream, call = answer_for(kind)
    writes: list[bytes] = []
    events = answer.sse()
    call._push(delta("A", [1]))
    writes.append(await anext(events))  # the first delta (chat: with the role)
    rows = [(0, "b", [2]), (0, "", [3]), (0, "c", [4, 5]), (0, "d", [6])]
    if behind:  # every row waits before the gateway gets back to the stream
        for row in rows:
            call._push(row)
    else:  # each row is sent before the next comes
        reading = asyncio.ensure_future(anext(events))
        for row in rows:
            await asyncio.sleep(0)
            call._push(row)
            if row[1]:
                writes.append(await reading)
                reading = asyncio.ensure_future(anext(events))
    call._push(delta("", [7], finish=common_pb2.FINISH_REASON_LENGTH))
    call._push(processor_pb2.GenerateResponse(usage=processor_pb2.Usage(prompt_tokens=1, completion_tokens=7)))
    call._finish(None)
    if not behind:
        writes.append(await reading)
    writes += [event async for event in events]
    return writes, stream._tokens[0]


async def test_rows_waiting_behind_a_row_go_out_with_it_byte_for_byte() -> None:
    for kind in (COMPLETION, CHAT):
        one_by_one, tokens_one = await sent_events(kind, behind=False)
        together, tokens_together = await sent_events(kind, behind=True)
        assert b"".join(together) == b"".join(one_by_one), kind.endpoint
        assert len(together) == len(one_by_one) - 2, kind.endpoint  # b, c and d in one write
        assert tokens_one == tokens_together == [1, 2, 3, 4, 5, 6, 7]
