"""The service runner: resources torn down in reverse start order, whatever ends the service."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from types import SimpleNamespace

import pytest

from services.mesh import service_runner
from services.mesh.flags import die
from services.mesh.service_runner import ServiceRunner


Step = Callable[[], Awaitable[None]]


@pytest.fixture(autouse=True)
def collector(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What the runner asks of the garbage collector, recorded and not done: over the test
    process's heap (every module the suite imported), not a service's, its full collection takes
    a third of a second, and its unfreeze would hand the whole heap back to the collector."""
    calls: list[str] = []
    stand_in = SimpleNamespace(**{name: (lambda name=name: calls.append(name))
                                  for name in ("collect", "freeze", "unfreeze")})
    monkeypatch.setattr(service_runner, "gc", stand_in)
    return calls


def recorder() -> tuple[list[str], Callable[[str], Step]]:
    """A log of teardown steps as they run, and a maker of steps that append their name to it."""
    log: list[str] = []

    def step(name: str) -> Step:
        async def action() -> None:
            log.append(name)
        return action

    return log, step


async def test_teardown_runs_in_reverse_start_order_after_a_stop(collector: list[str]) -> None:
    done, step = recorder()

    async def assemble(runner: ServiceRunner) -> None:
        for name in ("store", "server", "lease"):
            runner.on_teardown(name, step(name))
        asyncio.get_running_loop().call_soon(runner.request_stop, "test")

    assert await ServiceRunner("t").serve(assemble) == 0
    assert done == ["lease", "server", "store"]
    # Start-up's objects were left out of collections once assembled, and handed back at the end.
    assert collector == ["collect", "freeze", "unfreeze"]


async def test_a_start_up_failure_tears_down_what_was_acquired_and_exits_1() -> None:
    done, step = recorder()

    async def assemble(runner: ServiceRunner) -> None:
        runner.on_teardown("store", step("store"))
        raise RuntimeError("engine failed to load")

    assert await ServiceRunner("t").serve(assemble) == 1
    assert done == ["store"]


async def test_a_deliberate_exit_keeps_its_status_and_still_tears_down() -> None:
    done, step = recorder()

    async def assemble(runner: ServiceRunner) -> None:
        runner.on_teardown("store", step("store"))
        die("etcd unreachable", code=3)

    assert await ServiceRunner("t").serve(assemble) == 3
    assert done == ["store"]


async def test_a_failing_step_is_logged_and_the_earlier_ones_still_run(caplog: pytest.LogCaptureFixture) -> None:
    done, step = recorder()

    async def broken() -> None:
        raise OSError("socket already closed")

    async def assemble(runner: ServiceRunner) -> None:
        runner.on_teardown("store", step("store"))
        runner.on_teardown("server", broken)
        runner.request_stop("test")

    with caplog.at_level(logging.ERROR):
        assert await ServiceRunner("t").serve(assemble) == 0
    assert done == ["store"]
    assert "teardown step 'server' failed: socket already closed" in caplog.text


async def test_a_step_that_overruns_its_deadline_is_abandoned(caplog: pytest.LogCaptureFixture) -> None:
    done, step = recorder()
    hung = asyncio.Event()

    async def assemble(runner: ServiceRunner) -> None:
        runner.on_teardown("store", step("store"))
        runner.on_teardown("server", hung.wait, timeout_s=0.05)
        runner.request_stop("test")

    with caplog.at_level(logging.ERROR):
        assert await ServiceRunner("t").serve(assemble) == 0
    assert done == ["store"]
    assert "teardown step 'server' overran" in caplog.text


async def test_a_watched_task_that_crashes_stops_the_service_with_status_1() -> None:
    done, step = recorder()

    async def crash() -> None:
        await asyncio.sleep(0)
        raise ValueError("engine loop died")

    async def assemble(runner: ServiceRunner) -> None:
        runner.on_teardown("store", step("store"))
        runner.watch(asyncio.create_task(crash()), "the engine loop")

    assert await ServiceRunner("t").serve(assemble) == 1
    assert done == ["store"]


async def test_a_stop_during_start_up_abandons_the_assembly_and_tears_down() -> None:
    done, step = recorder()
    reached_the_slow_part = asyncio.Event()

    async def assemble(runner: ServiceRunner) -> None:
        runner.on_teardown("store", step("store"))
        reached_the_slow_part.set()
        await asyncio.Event().wait()  # an engine that takes forever to load
        runner.on_teardown("never", step("never"))

    runner = ServiceRunner("t")
    serving = asyncio.create_task(runner.serve(assemble))
    await asyncio.wait_for(reached_the_slow_part.wait(), 5)
    runner.request_stop("test")
    assert await asyncio.wait_for(serving, 5) == 0
    assert done == ["store"]


async def test_sigterm_stops_the_service_with_status_0() -> None:
    done, step = recorder()

    async def assemble(runner: ServiceRunner) -> None:
        runner.on_teardown("store", step("store"))
        os.kill(os.getpid(), signal.SIGTERM)

    assert await asyncio.wait_for(ServiceRunner("t").serve(assemble), 5) == 0
    assert done == ["store"]


async def test_watched_tasks_ended_by_a_failed_start_up_keep_its_exit_status() -> None:
    done, step = recorder()

    async def assemble(runner: ServiceRunner) -> None:
        runner.watch(asyncio.create_task(asyncio.Event().wait()), "a background loop")
        runner.on_teardown("store", step("store"))
        die("etcd unreachable", code=3)

    assert await ServiceRunner("t").serve(assemble) == 3
    assert done == ["store"]
