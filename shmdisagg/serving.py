"""uvicorn glue shared by the fleet worker and the coordinator."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Generator

import uvicorn


class EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to its process, and wakes once a second.

    uvicorn's `capture_signals` re-raises SIGTERM/SIGINT after shutdown, which would kill the
    process before its own ordered clean-up runs; our processes install their own handlers.

    uvicorn's `main_loop` wakes every 0.1 s to look at `should_exit` and, every tenth time, to
    refresh the `date` header. Here setting `should_exit` wakes the loop at once and the loop
    ticks once a second, when the header changes: an idle process wakes 1 time a second for
    uvicorn, not 10 (BENCHMARKS.md, "Idle wake-ups").
    """

    TICK_S = 1.0

    @property
    def should_exit(self) -> bool:
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._should_exit = value
        wake: asyncio.Event | None = getattr(self, "_wake", None)
        if value and wake is not None:
            wake.set()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def main_loop(self) -> None:
        self._wake = asyncio.Event()
        counter = 0
        while not await self.on_tick(counter):  # a multiple of 10: on_tick refreshes the date
            counter = (counter + 10) % 864000
            try:
                async with asyncio.timeout(self.TICK_S):
                    await self._wake.wait()
            except TimeoutError:
                pass


def on_stop_signals(callback: Callable[..., None], with_signal: bool = False) -> None:
    """Call `callback` (in the running loop) on SIGTERM or SIGINT; `with_signal`: with the
    signal's number as its argument."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, callback, *((sig,) if with_signal else ()))
