"""A worker's engine health watch: a dead or hung engine turns the worker NOT_SERVING and ends
the watch with the reason (the worker runtime then takes the worker out of the mesh)."""

from __future__ import annotations

import asyncio

import pytest
from grpc_health.v1 import health, health_pb2

from services.engines.mocker.engine import MockerConfig, MockerEngine
from services.engines.mocker.timing import TimingModel
from services.tools.make_demo_model import ensure_demo_model
from services.worker.engine_health import EngineFailed, watch_engine
from tests.procs import eventually

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def mocker() -> MockerEngine:
    model = ensure_demo_model()
    return MockerEngine(MockerConfig(model_dir=str(model), served_model_name=model.name,
                                     timing=TimingModel(speedup=float("inf"))))


async def status(servicer: health.HealthServicer, service: str = "") -> int:
    class Context:
        async def abort(self, code: object, details: str = "") -> None:
            raise AssertionError(f"unknown service {service!r}")

    reply = await servicer.Check(health_pb2.HealthCheckRequest(service=service), Context())
    return reply.status


async def test_a_mocker_whose_step_loop_died_fails_its_health_watch() -> None:
    engine = mocker()
    await engine.start()
    servicer = health.aio.HealthServicer()
    await servicer.set("kvmesh.v1.Worker", SERVING)
    checks = 0
    check_health = engine.check_health

    async def counted() -> None:
        nonlocal checks
        checks += 1
        await check_health()

    engine.check_health = counted  # type: ignore[method-assign]
    watch = asyncio.create_task(watch_engine(engine, servicer, "w1", every_s=0.01))
    assert await eventually(lambda: checks >= 3, 5)  # healthy checks passed
    assert not watch.done() and await status(servicer) == SERVING
    assert engine._loop_task is not None
    engine._loop_task.cancel()  # the engine loop is gone, as after a crash inside it
    with pytest.raises(EngineFailed, match="step loop was cancelled"):
        await asyncio.wait_for(watch, 5)
    assert await status(servicer) == NOT_SERVING
    assert await status(servicer, "kvmesh.v1.Worker") == NOT_SERVING
    await engine.stop()


async def test_an_engine_that_stops_answering_fails_after_repeated_overruns() -> None:
    class Hung(MockerEngine):
        async def check_health(self) -> None:
            await asyncio.Event().wait()

    model = ensure_demo_model()
    engine = Hung(MockerConfig(model_dir=str(model), served_model_name=model.name))
    servicer = health.aio.HealthServicer()
    with pytest.raises(EngineFailed, match="has not answered a health check for 3 checks"):
        await asyncio.wait_for(watch_engine(engine, servicer, "w1", every_s=0.01, deadline_s=0.02), 5)
    assert await status(servicer) == NOT_SERVING
