"""Unit tests start nothing: no child process, no etcd, no mesh. Starting a process here fails
the test at once, so a test that needs one is moved to tests/e2e/ rather than slowing
`make test-unit` down (in-process gRPC servers on loopback are fine: they start in milliseconds)."""

from __future__ import annotations

import asyncio
import gc
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest


def _refuse(*_: Any, **__: Any) -> Any:
    raise AssertionError("a unit test starts no process: move this test to tests/e2e/")


@pytest.fixture(autouse=True)
def no_processes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse)
    monkeypatch.setattr(asyncio, "create_subprocess_exec", _refuse)
    monkeypatch.setattr(asyncio, "create_subprocess_shell", _refuse)
    yield


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session) -> Iterator[object]:
    """What collection imports (every module the tests use: millions of objects, alive until the
    end) is collected once and then left out of every later garbage collection, as a service
    leaves its start-up objects out (service_runner.freeze_start_up_objects). Otherwise each full
    collection, during the imports and after, walks the whole heap again: a third of a second
    each, a quarter of the suite's time. They stay frozen to the exit, which then skips freeing
    them one by one (seconds). Modules imported later (torch, by the tokenizer's tests) are not
    frozen: native extensions among them report frozen objects as leaked at exit."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return (yield)
    finally:
        gc.collect()
        gc.freeze()
        if enabled:
            gc.enable()
