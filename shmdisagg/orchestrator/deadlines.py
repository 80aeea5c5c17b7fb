"""The requests a fleet worker is running, and their deadlines (`request_timeout_s`) on one timer.

Every request of a worker has the same timeout, so deadlines come due in the order the requests
began. The open requests live in an insertion-ordered dict, and one loop timer waits for the
first one's deadline; when it fires it expires what is due and moves on to the next open request.
A request that ends just leaves the dict. So a request costs a dict insert and delete instead of a
`call_later` and its cancel (a handle, a libuv timer, a heap insert and removal and a close
callback: 0.6 µs in uvloop in a hot loop, more on a request's cold caches), and libuv's timer
heap holds one node for the worker instead of one per open request (with 2,048 open streams its
inserts and removals walk 12 levels of cold nodes: BENCHMARKS.md "Open streams and long prompts,
beside vLLM's Rust router").
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")

# A loop timer may fire up to the clock's resolution (1 ms in libuv) early.
_EARLY_S = 1e-3


class OpenRequests(Generic[T]):
    """Tasks running a request, each with its deadline `timeout_s` after it was opened.

    `expire(task, item)` runs once for a task still open at its deadline (it is closed first);
    a task closed before then is never passed to it. Iterating yields the open tasks, oldest first.
    """

    __slots__ = ("timeout_s", "expire", "_open", "_timer", "_loop")

    def __init__(self, timeout_s: float, expire: Callable[[asyncio.Task[Any], T], None]) -> None:
        self.timeout_s = timeout_s
        self.expire = expire
        self._open: dict[asyncio.Task[Any], tuple[float, T]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def open(self, task: asyncio.Task[Any], item: T) -> None:
        """Start `task`'s deadline, `timeout_s` from now on its loop's clock."""
        loop = task.get_loop()
        if loop is not self._loop:  # the first request, or a service run again on a new loop
            self._loop, self._timer = loop, None
        deadline = loop.time() + self.timeout_s
        self._open[task] = (deadline, item)
        if self._timer is None:  # else it fires at an earlier deadline, and then moves on
            self._timer = loop.call_at(deadline, self._fire)

    def close(self, task: asyncio.Task[Any]) -> None:
        """`task` ended (or was expired): forget it. Idempotent."""
        self._open.pop(task, None)

    def __len__(self) -> int:
        return len(self._open)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._open))

    def _fire(self) -> None:
        self._timer = None
        loop = self._loop
        assert loop is not None
        now = loop.time() + _EARLY_S
        due: list[tuple[asyncio.Task[Any], T]] = []
        for task, (deadline, item) in self._open.items():
            if deadline > now:
                self._timer = loop.call_at(deadline, self._fire)
                break
            due.append((task, item))
        for task, item in due:
            del self._open[task]
            self.expire(task, item)
