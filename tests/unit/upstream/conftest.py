"""Fixtures for the upstream client tests: every test runs on plain asyncio and on uvloop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest
import uvloop

T = TypeVar("T")
Run = Callable[[Coroutine[Any, Any, T]], T]

# A test that deadlocks (e.g. a client that buffers a stream) fails after this instead of hanging.
TEST_DEADLINE_S = 30.0


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Run[Any]:
    """Run a coroutine to completion on a fresh loop of the parametrised kind, bounded in time."""
    factory = uvloop.new_event_loop if request.param == "uvloop" else None

    def _run(coro: Coroutine[Any, Any, T]) -> T:
        async def bounded() -> T:
            async with asyncio.timeout(TEST_DEADLINE_S):
                return await coro

        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(bounded())

    return _run
