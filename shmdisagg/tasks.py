"""Background asyncio tasks: stopping one."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def stop_task(task: asyncio.Future[Any] | None) -> None:
    """Cancel `task` (None: nothing to do) and wait until it has finished unwinding."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
