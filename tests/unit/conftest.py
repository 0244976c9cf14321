"""Unit tests start nothing: no child process, no etcd, no mesh. Starting a process here fails
the test at once, so a test that needs one is moved to tests/e2e/ rather than slowing
`make test-unit` down (in-process gRPC servers on loopback are fine: they start in milliseconds)."""

from __future__ import annotations

import asyncio
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
