"""What a hop adds to a token's latency (mesh/hop_latency.py): frames carry their write time, a
serving end records from each reply's origin to its frame's write, a reply made while an upstream
frame is read counts from that frame's write, and a calling end knows each response's frame."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from gen.kvmesh.v1 import common_pb2, processor_pb2, processor_pb2_grpc
from services.mesh.channels import ChannelPool
from services.mesh.hop_latency import FrameClock, HopLatency, hop_latency_histogram
from services.mesh.session_client import SessionPool
from services.mesh.session_kind import PROCESSOR_SESSION, CallInfo
from services.mesh.session_server import SessionHub
from tests.unit.in_process_grpc import serving

STEP_S = 0.02


def samples(registry: CollectorRegistry, hop: str) -> tuple[float, float]:
    """(count, sum) of the hop's histogram."""
    count = registry.get_sample_value("kvmesh_hop_latency_seconds_count", {"hop": hop}) or 0.0
    total = registry.get_sample_value("kvmesh_hop_latency_seconds_sum", {"hop": hop}) or 0.0
    return count, total


def test_a_reply_made_while_an_upstream_frame_is_read_counts_from_that_frame() -> None:
    registry = CollectorRegistry()
    upstream = FrameClock()
    latency = HopLatency(hop_latency_histogram(registry), "processor", upstream)
    before = time.time_ns()
    assert before <= latency.origin_ns() <= time.time_ns()  # nothing read: from now
    upstream.reading_ns = before - 3_000_000
    assert latency.origin_ns() == before - 3_000_000
    latency.record(latency.origin_ns(), before)
    assert samples(registry, "processor") == (1.0, 0.003)


class Stepper(processor_pb2_grpc.ProcessorServicer):
    """Makes each reply through `CallInfo.reply` while pretending to read an upstream frame
    written `STEP_S` earlier, as a processor's row sink does; the next only once the caller (on
    the same loop) has read it, so each leaves in a frame of its own."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.read = 0
        self.read_more = asyncio.Event()
        self.upstream = FrameClock()
        self.sessions = SessionHub(PROCESSOR_SESSION, self.handle,
                                   latency=HopLatency(hop_latency_histogram(registry), "processor", self.upstream))

    async def Session(self, frames: AsyncIterator[processor_pb2.ProcessorSessionDown],  # noqa: N802
                      context: grpc.aio.ServicerContext) -> None:
        await self.sessions.serve(frames, context)

    async def handle(self, request: processor_pb2.GenerateRequest, call: CallInfo) -> AsyncIterator[Any]:
        yield processor_pb2.GenerateResponse(delta=processor_pb2.ChoiceDelta(text="first"))
        assert call.reply is not None
        for k in range(3):
            self.upstream.reading_ns = time.time_ns() - int(STEP_S * 1e9)
            call.reply((0, f"row {k}", [k]))
            self.upstream.reading_ns = 0
            while self.read < k + 2:  # the first reply and this row
                self.read_more.clear()
                await asyncio.wait_for(self.read_more.wait(), 10)
        yield processor_pb2.GenerateResponse(
            delta=processor_pb2.ChoiceDelta(text=".", finish_reason=common_pb2.FINISH_REASON_STOP))


async def test_frames_carry_their_write_time_and_the_serving_end_records_what_it_added() -> None:
    registry = CollectorRegistry()
    stepper = Stepper(registry)
    started = time.time_ns()
    async with serving(processor_pb2_grpc.add_ProcessorServicer_to_server, stepper) as address:
        channels = ChannelPool()
        sessions = SessionPool(channels)
        try:
            stream = sessions.get(PROCESSOR_SESSION, address).open(processor_pb2.GenerateRequest(), 10)
            frame_times = []
            async for _ in stream:
                frame_times.append(stream.frame_ns)
                stepper.read += 1
                stepper.read_more.set()
        finally:
            await sessions.close()
            await channels.close()
    ended = time.time_ns()
    # Written while the call ran, in order.
    assert len(frame_times) == 5 and started <= frame_times[0] and frame_times[-1] <= ended, frame_times
    assert frame_times == sorted(frame_times)
    count, total = samples(registry, "processor")
    # Every frame records its oldest reply's origin: the three rows' frames count from STEP_S
    # before them, the first and last replies' from their own making; none from before the call.
    assert count >= 3
    assert STEP_S * 3 <= total <= STEP_S * 3 + count * (ended - started) / 1e9
