"""`OpenRequests`: every open request's deadline on one timer (orchestrator/deadlines.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import uvloop

from shmdisagg.orchestrator.deadlines import OpenRequests
from tests.loop_timers import armed_timers


@pytest.fixture(params=["asyncio", "uvloop"])
def runner(request: pytest.FixtureRequest) -> Any:
    factory = uvloop.new_event_loop if request.param == "uvloop" else None
    with asyncio.Runner(loop_factory=factory) as r:
        yield r


async def _held(release: asyncio.Event) -> None:
    await release.wait()


def test_a_request_still_open_at_its_deadline_is_expired_once_and_closed(runner: asyncio.Runner) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        expired: list[tuple[asyncio.Task[Any], str, float]] = []
        done = asyncio.Event()

        def expire(task: asyncio.Task[Any], item: str) -> None:
            expired.append((task, item, loop.time()))
            done.set()

        reqs: OpenRequests[str] = OpenRequests(0.1, expire)
        task = asyncio.create_task(_held(asyncio.Event()))
        t0 = loop.time()
        reqs.open(task, "a")
        await done.wait()
        assert [(t, i) for t, i, _ in expired] == [(task, "a")]
        assert expired[0][2] - t0 >= 0.1 - 1e-3
        assert len(reqs) == 0 and list(reqs) == []
        task.cancel()

    runner.run(main())


def test_requests_closed_in_time_are_never_expired_and_later_ones_still_are(runner: asyncio.Runner) -> None:
    """The timer armed for the first request finds it closed, and waits for the next open one's
    deadline instead: the later request expires at its own deadline, not the first one's."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        expired: list[tuple[str, float]] = []
        done = asyncio.Event()

        def expire(task: asyncio.Task[Any], item: str) -> None:
            expired.append((item, loop.time()))
            done.set()

        reqs: OpenRequests[str] = OpenRequests(0.2, expire)
        release = asyncio.Event()
        first = asyncio.create_task(_held(release))
        reqs.open(first, "first")
        await asyncio.sleep(0.1)  # the behaviour under test is the passage of time
        second = asyncio.create_task(_held(asyncio.Event()))
        t1 = loop.time()
        reqs.open(second, "second")
        reqs.close(first)
        release.set()
        await done.wait()
        assert [i for i, _ in expired] == ["second"]
        assert expired[0][1] - t1 >= 0.2 - 1e-3
        second.cancel()

    runner.run(main())


def test_requests_expire_in_the_order_they_opened_and_iteration_lists_the_open_ones(runner: asyncio.Runner) -> None:
    async def main() -> None:
        expired: list[int] = []
        all_done = asyncio.Event()

        def expire(task: asyncio.Task[Any], item: int) -> None:
            expired.append(item)
            if len(expired) == 3:
                all_done.set()

        reqs: OpenRequests[int] = OpenRequests(0.05, expire)
        tasks = [asyncio.create_task(_held(asyncio.Event())) for _ in range(5)]
        for i, t in enumerate(tasks):
            reqs.open(t, i)
        reqs.close(tasks[1])
        reqs.close(tasks[3])
        reqs.close(tasks[3])  # idempotent
        assert list(reqs) == [tasks[0], tasks[2], tasks[4]] and len(reqs) == 3
        await all_done.wait()
        assert expired == [0, 2, 4]
        for t in tasks:
            t.cancel()

    runner.run(main())


def test_open_requests_use_one_loop_timer(runner: asyncio.Runner) -> None:
    """A call_later and its cancel per request cost 0.6 µs or more in uvloop: 100 requests opened and
    closed one after another arm one timer between them."""

    async def main() -> None:
        reqs: OpenRequests[int] = OpenRequests(30.0, lambda task, item: None)
        task = asyncio.current_task()
        assert task is not None
        with armed_timers(asyncio.get_running_loop()) as armed:
            for i in range(100):
                reqs.open(task, i)
                reqs.close(task)
        assert len(armed) == 1

    runner.run(main())


def test_requests_on_a_second_loop_get_their_own_timer() -> None:
    """A service run on one loop, then on another (tests, a restarted worker loop): the first
    loop's pending timer never fires, so the second loop's requests get a timer of their own."""
    expired: list[int] = []
    woken: list[asyncio.Event] = []

    def expire(task: asyncio.Task[Any], item: int) -> None:
        expired.append(item)
        for event in woken:
            event.set()

    reqs: OpenRequests[int] = OpenRequests(30.0, expire)

    async def first() -> None:
        task = asyncio.current_task()
        assert task is not None
        reqs.open(task, 1)
        reqs.close(task)

    asyncio.run(first())
    reqs.timeout_s = 0.05

    async def second() -> None:
        woken.append(asyncio.Event())
        task = asyncio.create_task(_held(asyncio.Event()))
        reqs.open(task, 2)
        async with asyncio.timeout(5):  # without its own timer it would never expire
            await woken[0].wait()
        task.cancel()

    asyncio.run(second())
    assert expired == [2]
