"""Fleet worker -> coordinator failure reports, off the request path.

A worker that cannot reach an executor tells the coordinator (`POST /report` on its Unix socket),
which probes that executor at once and, if it refuses or keeps failing, marks it unhealthy in the
table for the whole fleet. Reports are coalesced per (server, kind) while one is pending and sent
by one background task; when the coordinator is unreachable they are dropped (its own health
poll still catches the failure within one interval).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp

log = logging.getLogger("shmdisagg.fleet")


class FailureReporter:
    """Queue of (slot, kind) reports; `report` never blocks or raises."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self._pending: dict[tuple[int, str], None] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.sent = 0
        self.dropped = 0

    def report(self, slot: int, kind: str) -> None:
        self._pending[(slot, kind)] = None
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=1.0)
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self.socket_path), timeout=timeout) as session:
            while True:
                await self._wake.wait()
                self._wake.clear()
                batch, self._pending = list(self._pending), {}
                payload = [{"slot": slot, "kind": kind} for slot, kind in batch]
                try:
                    async with session.post("http://coordinator/report", json=payload) as r:
                        r.release()
                    self.sent += len(payload)
                except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as err:
                    self.dropped += len(payload)
                    log.debug("failure report not delivered: %r", err)
