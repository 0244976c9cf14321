"""Clocks for unit tests, so that none waits on the wall clock or bounds its time.

- `FakeClock`: a `Callable[[], float]` that moves only when the test says (`advance`), for code
  that reads a clock and never waits on it (RefusalMemory, an AdapterSet's load times).
- `virtual_time`: runs an async test on a `VirtualTimeLoop`, an event loop whose `time()` stands
  still while anything is ready to run and jumps to the next timer once nothing is: sleeps,
  timeouts and `call_later` cost no wall time, and every duration a test measures with
  `loop.time()` is exact. For code that waits on its loop (the mocker's steps, pacing). A test on
  it does no network I/O: a reply from a socket or another thread's callback takes wall time,
  which this loop would skip over. Work handed to the loop's executor (`asyncio.to_thread`) is
  waited for in wall time, with the virtual clock held.
- `advance(s)`: lets `s` seconds of virtual time pass (refused on a real loop, where it would be
  a sleep).
- `until(predicate)`: yields to the loop until `predicate()` holds, a bounded number of turns on
  a real loop, or within `within_s` of a virtual one.
"""

from __future__ import annotations

import asyncio
import functools
import selectors
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class FakeClock:
    """A monotonic clock that moves only by `advance`."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, "a monotonic clock never goes back"
        self.now += seconds


class _VirtualSelector(selectors.DefaultSelector):
    """The loop's selector: a wait for a timer passes virtual time instead of wall time."""

    loop: VirtualTimeLoop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or (timeout is not None and timeout <= 0):
            return ready
        if self.loop.in_executor:
            # A thread's result wakes the loop through its self-pipe: wait for it in wall time.
            return super().select(0.01 if timeout is None else min(timeout, 0.01))
        if timeout is None:
            return super().select(None)  # no timer at all: only another thread can wake it
        self.loop.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on a virtual clock (see the module docstring)."""

    def __init__(self) -> None:
        selector = _VirtualSelector()
        super().__init__(selector)
        selector.loop = self
        self.now = 0.0
        self.in_executor = 0

    def time(self) -> float:
        return self.now

    def run_in_executor(self, executor: Executor | None, func: Callable[..., T],  # type: ignore[override]
                        *args: Any) -> asyncio.Future[T]:
        future = super().run_in_executor(executor, func, *args)
        self.in_executor += 1

        def finished(_: asyncio.Future[T]) -> None:
            self.in_executor -= 1

        future.add_done_callback(finished)
        return future


def virtual_time(test: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, T]:
    """Runs the async test `test` on a VirtualTimeLoop of its own (a plain test to pytest)."""

    @functools.wraps(test)
    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        return run_in_virtual_time(test(*args, **kwargs))

    return run


def run_in_virtual_time(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on a VirtualTimeLoop."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(main)


async def advance(seconds: float) -> None:
    """Lets `seconds` of virtual time pass, running whatever falls due meanwhile."""
    assert isinstance(asyncio.get_running_loop(), VirtualTimeLoop), "advance() is for a test in virtual time"
    await asyncio.sleep(seconds)


async def until(predicate: Callable[[], object], within_s: float = 60.0, turns: int = 10_000) -> None:
    """Yields to the loop until `predicate()` holds: at most `turns` times on a real loop (work
    that needs no timer and no I/O is done within a few), within `within_s` of virtual time on
    a virtual one."""
    loop = asyncio.get_running_loop()
    if isinstance(loop, VirtualTimeLoop):
        deadline = loop.time() + within_s
        while not predicate():
            assert loop.time() < deadline, f"not reached within {within_s} s of virtual time"
            await asyncio.sleep(0.001)
        return
    for _ in range(turns):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"not reached within {turns} turns of the event loop")
