"""Fleet worker -> coordinator messages, off the request path: failure reports and KV poll hints.

A worker that cannot reach an executor tells the coordinator (`POST /report` on its Unix socket),
which probes that executor at once and, if it refuses or keeps failing, marks it unhealthy in the
table for the whole fleet. Reports are coalesced per (server, kind) while one is pending and sent
by one background task; when the coordinator is unreachable they are dropped (its own health
poll still catches the failure within one interval).

KV poll hints (`KvHints`): at the moments after which an executor has new KV events (a context
leg's response read, a generation leg's first chunk and its end; see `flows.py`), the worker
tells the coordinator which server slot to drain (`coordinator/kv_events.py`). A hint is one
non-blocking `sendto` of 8 bytes (`HINT_MAGIC` + the slot, u32 little-endian) on a Unix datagram
socket, about 15 us: no task, no await, no retry. A hint that cannot be sent (the coordinator's
queue is full, or it is gone) is counted in `failed` and dropped; the coordinator's fallback
poll picks those events up.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import aiohttp

from shmdisagg.tasks import stop_task

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
        await stop_task(self._task)

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=1.0)
        async with aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=self.socket_path), timeout=timeout
        ) as session:
            while True:
                await self._wake.wait()
                self._wake.clear()
                batch, self._pending = list(self._pending), {}
                payload = [{"slot": slot, "kind": kind} for slot, kind in batch]
                try:
                    async with session.post("http://coordinator/report", json=payload) as r:
                        r.release()
                    self.sent += len(payload)
                except (TimeoutError, aiohttp.ClientError, OSError) as err:
                    self.dropped += len(payload)
                    log.debug("failure report not delivered: %r", err)


HINT_MAGIC = b"KVH1"


def hint_message(slot: int) -> bytes:
    """The datagram that asks the coordinator to drain server `slot`'s KV events now."""
    return HINT_MAGIC + slot.to_bytes(4, "little")


class KvHints:
    """Sends KV poll hints; `hint` never blocks or raises. Counters: `sent`, `failed`."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._messages: dict[int, bytes] = {}
        self.sent = 0
        self.failed = 0

    def hint(self, slot: int) -> None:
        msg = self._messages.get(slot)
        if msg is None:
            if not 0 <= slot < 1 << 32:
                return
            msg = self._messages[slot] = hint_message(slot)
        try:
            self._sock.sendto(msg, self.socket_path)
            self.sent += 1
        except OSError:
            self.failed += 1

    def close(self) -> None:
        self._sock.close()
