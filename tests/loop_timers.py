"""Counting the timers a piece of code arms on an event loop (asyncio's `call_later` goes through
`call_at` too, on plain asyncio and on uvloop)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def armed_timers(loop: asyncio.AbstractEventLoop) -> Iterator[list[float]]:
    """The loop times of every `loop.call_at` made inside the block, in order."""
    call_at = loop.call_at
    armed: list[float] = []

    def counted(when: float, callback: Any, *args: Any, context: Any = None) -> asyncio.TimerHandle:
        armed.append(when)
        return call_at(when, callback, *args, context=context)

    loop.call_at = counted  # type: ignore[method-assign]
    try:
        yield armed
    finally:
        del loop.call_at
