"""vllm_row_tap against vLLM's own RequestOutputCollector and RequestOutput: while the request's
task waits in the collector's `get`, plain outputs go to the tap; the last output, one with KV
transfer parameters, and any that comes while the task is not waiting go the collector's way, in
order; a request whose collector cannot be found is left alone.

Marked `vllm`, and vLLM imported only when a test runs: importing it takes seconds, which
`make test-unit` (`-m "not vllm"`) does not pay; `make test` runs these with the vLLM tests."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from services.engines.base import RowTap
from services.engines.vllm_row_tap import tap_request

pytestmark = pytest.mark.vllm


def collector_for(request_id: str) -> Any:
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.output_processor import RequestOutputCollector

    return RequestOutputCollector(RequestOutputKind.DELTA, request_id)


def output(tokens: list[int], finished: bool = False, kv: dict | None = None) -> Any:
    from vllm.outputs import CompletionOutput, RequestOutput

    return RequestOutput("r-internal", None, [1, 2], None, [CompletionOutput(0, "", tokens, None, None)], finished,
                         num_cached_tokens=0, kv_transfer_params=kv)


def engine_with(collector: Any) -> SimpleNamespace:
    """What tap_request reads of an AsyncLLM: its output processor's request bookkeeping."""
    return SimpleNamespace(output_processor=SimpleNamespace(external_req_ids={"r": ["r-internal"]},
                                                            request_states={"r-internal": SimpleNamespace(queue=collector)}))


async def test_plain_outputs_skip_the_task_only_while_it_waits_in_get() -> None:
    collector = collector_for("r-internal")
    tapped: list[list[int]] = []
    tap = RowTap()
    assert tap_request(engine_with(collector), "r", tap)
    tap.open(tapped.append, 0.0)
    read: list[list[int]] = []

    async def generate() -> None:  # as AsyncLLM.generate reads its collector
        finished = False
        while not finished:
            out = collector.get_nowait() or await collector.get()
            read.append(list(out.outputs[0].token_ids))
            finished = out.finished

    task = asyncio.create_task(generate())
    await asyncio.sleep(0)  # the task waits in get
    collector.put(output([10]))  # to the tap
    collector.put(output([11]))  # to the tap
    collector.put(output([12], kv={"remote": 1}))  # KV parameters: the collector's way
    collector.put(output([13]))  # the task has not read [12] yet: the collector's way, merged after it
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    collector.put(output([14]))  # waiting again: to the tap
    collector.put(output([15], finished=True))  # the last: the collector's way
    await asyncio.wait_for(task, 5)
    assert tapped == [[10], [11], [14]]
    assert read == [[12, 13], [15]]


def test_a_request_whose_collector_cannot_be_found_is_left_alone() -> None:
    collector = collector_for("r-internal")
    assert not tap_request(engine_with(collector), "another", RowTap())
    assert not tap_request(SimpleNamespace(), "r", RowTap())
    assert collector.put.__name__ == "put"  # untouched
