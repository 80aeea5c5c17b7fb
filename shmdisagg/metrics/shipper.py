"""Fleet worker -> coordinator per-request records, in batches, off the request path.

`add` (called by the metrics sink at the end of each routed request) only appends a tuple to a
list. A background task sends what accumulated every `FLUSH_S` (or as soon as `BATCH` records
wait) as one `POST /perf_records` on the coordinator's Unix socket: one HTTP exchange costs the
worker about a millisecond of CPU, so batches are kept large (at 50 requests/s a worker spends
~0.02 ms per request on it); `flush()` sends at once (a worker answering `GET /perf_metrics`
flushes its own records before asking the coordinator). While the coordinator is unreachable
records wait, at most `max_pending` of them; beyond that the oldest are dropped and counted in
`shmdisagg_perf_records_dropped`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any

import aiohttp
import orjson

from shmdisagg.metrics.schema import LAYOUT
from shmdisagg.tasks import stop_task

log = logging.getLogger("shmdisagg.metrics")

FLUSH_S = 1.0
BATCH = 1000
MAX_PENDING = 20_000


class RecordShipper:
    """State: `_pending` (records not yet sent, oldest first); `sent`, `dropped` (totals)."""

    def __init__(
        self, socket_path: str, worker_index: int, row: memoryview[float] | None = None, max_pending: int = MAX_PENDING
    ) -> None:
        self.socket_path = socket_path
        self.worker_index = worker_index
        self.max_pending = max_pending
        self.sent = 0
        self.dropped = 0
        self._row = row
        self._pending: list[tuple[Any, ...]] = []
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    def add(self, record: tuple[Any, ...]) -> None:
        self._pending.append(record)
        if len(self._pending) >= BATCH:
            self._wake.set()

    def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=self.socket_path), timeout=aiohttp.ClientTimeout(total=2.0)
        )
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """Send what is pending (best effort, bounded by the client timeout), then close."""
        await stop_task(self._task)
        self._task = None
        if self._session is not None:
            with contextlib.suppress(Exception):
                await self.flush()
            await self._session.close()
            self._session = None

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), FLUSH_S)
            self._wake.clear()
            await self.flush()

    async def flush(self) -> bool:
        """Send every pending record now; False if the coordinator did not take them."""
        async with self._lock:
            if not self._pending or self._session is None:
                return True
            batch, self._pending = self._pending, []
            payload = orjson.dumps(
                {
                    "worker": self.worker_index,
                    "pid": os.getpid(),
                    # the records' times are wall clock; this turns them into CLOCK_MONOTONIC
                    "monotonic_minus_wall": time.monotonic() - time.time(),
                    "records": batch,
                }
            )
            try:
                async with self._session.post(
                    "http://coordinator/perf_records", data=payload, headers={"content-type": "application/json"}
                ) as r:
                    await r.read()
                    ok = r.status == 200
            except (TimeoutError, aiohttp.ClientError, OSError) as err:
                log.debug("perf records not delivered: %r", err)
                ok = False
            if ok:
                self.sent += len(batch)
                return True
            self._pending[:0] = batch  # keep them for the next round, oldest first
            excess = len(self._pending) - self.max_pending
            if excess > 0:
                del self._pending[:excess]
                self.dropped += excess
                if self._row is not None:
                    self._row[LAYOUT.counter["shmdisagg_perf_records_dropped"]] += excess
            return False
