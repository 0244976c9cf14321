"""Ending background tasks: cancel, then wait until they have really ended."""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(*tasks: asyncio.Future[Any]) -> None:
    """Cancels the tasks and waits until each has ended, whatever it raised on the way out."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
