"""The live progress bar on stderr, and its no-op stand-in.

Redraws from `LoadCounters` four times a second from an event-loop task, instead of on every
completion and instead of rich's refresh thread, so the display costs the client almost nothing.
"""

from __future__ import annotations

import asyncio
import sys
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from shmdisagg.bench.load import LoadCounters
from shmdisagg.tasks import stop_task

_REFRESH_S = 0.25


class NullProgress:
    """Used with `--no-progress` or when stderr is not a terminal."""

    def __init__(self, counters: LoadCounters) -> None:
        self.counters = counters

    async def __aenter__(self) -> NullProgress:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None


class LiveProgress(NullProgress):
    """Bar of finished/total with sent and error counts."""

    def __init__(self, counters: LoadCounters, console: Console | None = None) -> None:
        super().__init__(counters)
        self._progress = Progress(
            TextColumn("[bold]bench"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("sent {task.fields[sent]}  errors {task.fields[errors]}"),
            TimeElapsedColumn(),
            console=console or Console(stderr=True),
            auto_refresh=False,
            transient=False,
        )
        self._task_id = self._progress.add_task("bench", total=counters.total, sent=0, errors=0)
        self._ticker: asyncio.Task[None] | None = None

    def _draw(self) -> None:
        c = self.counters
        self._progress.update(self._task_id, completed=c.finished, total=c.total, sent=c.sent, errors=c.errors)
        self._progress.refresh()

    async def _tick(self) -> None:
        while True:
            self._draw()
            await asyncio.sleep(_REFRESH_S)

    async def __aenter__(self) -> LiveProgress:
        self._progress.start()
        self._ticker = asyncio.create_task(self._tick())
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await stop_task(self._ticker)
        self._draw()
        self._progress.stop()


def progress_for(counters: LoadCounters, enabled: bool) -> NullProgress:
    """The live bar when enabled and stderr is a terminal, else the no-op."""
    if enabled and sys.stderr.isatty():
        return LiveProgress(counters)
    return NullProgress(counters)
