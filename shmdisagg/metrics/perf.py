"""The coordinator's per-request perf records, joined with the executors' own.

Fleet workers send each routed request's record (`POST /perf_records` on the coordinator's Unix
socket, see `shipper.py`). The coordinator polls every executor's `GET /perf_metrics` (drained
on read by the executor) every `POLL_S`, keeps those records by request id, and joins them as
TensorRT-LLM's orchestrator did (`serve/perf_metrics.py` @07fe6311): the context side is
the context server's record whose `ctx_request_id` equals the request's `disagg_request_id`, the
generation side the generation server's record with the same `ctx_request_id`.

A record waits (in `_pending`) until both of its sides arrived, or `grace_s` passed, or its
server has never returned any perf record (an executor without `return_perf_metrics`); then it
moves to `_ready`, a ring of at most `max_requests` records, TensorRT-LLM's
`perf_metrics_max_requests` (the oldest are dropped first). As in TensorRT-LLM's
`DisaggPerfMetricsCollector` (`serve/perf_metrics.py` @07fe6311: a `deque(maxlen=max_requests)`
of requests, each server's records capped at `max_requests`), 0, the default, keeps none: the
store takes no record, never polls the executors (whose own `/perf_metrics` buffers stay theirs
to drain) and `GET /perf_metrics` answers `[]`.

`GET /perf_metrics` drains `_ready` like TensorRT-LLM's endpoint (a record is returned once, to
whichever worker's client asks first); `?keep=1` reads without draining, for dashboards.

Times: the workers' records are wall clock; they are turned into CLOCK_MONOTONIC seconds here,
the steady clock the executors on this host stamp their records with (TensorRT-LLM's executors
use the steady clock too, shifted by any offset an orchestrator POSTed to them; shmdisagg never
posts one), so every time in a joined record is on one timebase.

Single-threaded: every method runs on the coordinator's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from typing import Any

import aiohttp

from shmdisagg.metrics.request import RECORD_FIELDS, observe_into
from shmdisagg.tasks import stop_task

log = logging.getLogger("shmdisagg.coordinator")

POLL_S = 0.5
GRACE_S = 2.0
UNSUPPORTED_RETRY_S = 60.0

_TIMES = (
    ("arrival", "disagg_server_arrival_time"),
    ("ctx_dispatch", "disagg_ctx_dispatch_time"),
    ("ctx_done", "disagg_ctx_done_time"),
    ("gen_dispatch", "disagg_gen_dispatch_time"),
    ("first_token", "disagg_server_first_token_time"),
    ("last_token", "disagg_server_last_token_time"),
)


class PerfStore:
    """State:
    - `servers`: slot -> "host:port" of every executor;
    - `_pending`: (loop time received, record) waiting for executor records, oldest first;
    - `_ready`: joined records, at most `max_requests`;
    - `_exec`: server -> {ctx_request_id: executor record}, each at most `max_requests`;
    - `_reporting`: servers that ever returned a perf record (so their side is waited for);
    - `_unsupported`: server -> loop time before which it is not polled again (404).
    """

    def __init__(
        self,
        servers: dict[int, str],
        max_requests: int = 0,
        row: memoryview[float] | None = None,
        grace_s: float = GRACE_S,
    ) -> None:
        self.servers = servers
        self.max_requests = max(max_requests, 0)
        self.grace_s = grace_s
        self.received = 0
        self.dropped = 0
        self._row = row
        self._pending: deque[tuple[float, dict[str, Any]]] = deque()
        self._ready: deque[dict[str, Any]] = deque()
        self._exec: dict[str, OrderedDict[int, dict[str, Any]]] = {}
        self._reporting: set[str] = set()
        self._unsupported: dict[str, float] = {}
        self._poll_lock = asyncio.Lock()
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None

    # -- from fleet workers ---------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """False for `perf_metrics_max_requests: 0`: no records are kept."""
        return self.max_requests > 0

    def add_batch(self, payload: dict[str, Any]) -> int:
        """A worker's `POST /perf_records` body; returns how many records it kept."""
        if not self.enabled:
            return 0
        off = float(payload.get("monotonic_minus_wall") or 0.0)
        worker = payload.get("worker")
        now = time.monotonic()
        n = 0
        for values in payload.get("records") or ():
            if len(values) != len(RECORD_FIELDS):
                continue
            r = dict(zip(RECORD_FIELDS, values, strict=True))
            rec: dict[str, Any] = {
                "disagg_request_id": r["disagg_request_id"],
                "ctx_server": self.servers.get(r["ctx_slot"]),
                "gen_server": self.servers.get(r["gen_slot"]),
            }
            for ours, theirs in _TIMES:
                rec[theirs] = r[ours] + off if r[ours] else None
            rec.update(
                status=r["status"],
                error_code=r["error_code"] or None,
                stream=r["stream"],
                prompt_tokens=r["prompt_tokens"],
                cached_tokens=r["cached_tokens"],
                retries=r["retries"],
                fleet_worker=worker,
                ctx_perf_metrics=None,
                gen_perf_metrics=None,
            )
            self._pending.append((now, rec))
            n += 1
        self.received += n
        while len(self._pending) > self.max_requests:  # nobody joins them in time: keep it bounded
            self._ready_append(self._pending.popleft()[1])
        return n

    # -- from executors -------------------------------------------------------------------

    async def poll_executors(self) -> None:
        """Drain every executor's `/perf_metrics` into `_exec` (one poll at a time)."""
        session = self._session
        if session is None:
            return
        async with self._poll_lock:
            now = time.monotonic()
            addrs = [a for a in self.servers.values() if self._unsupported.get(a, 0.0) <= now]
            results = await asyncio.gather(*(self._fetch(session, a) for a in addrs), return_exceptions=True)
            for addr, got in zip(addrs, results, strict=True):
                if isinstance(got, list):
                    self._store(addr, got)

    async def _fetch(self, session: aiohttp.ClientSession, addr: str) -> list[Any] | None:
        try:
            async with session.get(f"http://{addr}/perf_metrics") as r:
                if r.status == 404:
                    self._unsupported[addr] = time.monotonic() + UNSUPPORTED_RETRY_S
                    return None
                if r.status != 200:
                    return None
                data = await r.json(content_type=None)
                return data if isinstance(data, list) else None
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return None

    def _store(self, addr: str, records: list[Any]) -> None:
        book = self._exec.setdefault(addr, OrderedDict())
        for item in records:
            if not isinstance(item, dict):
                continue
            rid = item.get("ctx_request_id", item.get("request_id"))
            if isinstance(rid, int):
                book[rid] = item
                self._reporting.add(addr)
        while len(book) > self.max_requests:
            book.popitem(last=False)

    # -- joining --------------------------------------------------------------------------

    def join(self, now: float | None = None) -> None:
        """Attach executor records to pending requests; move finished ones to `_ready`."""
        now = time.monotonic() if now is None else now
        waiting: deque[tuple[float, dict[str, Any]]] = deque()
        for received, rec in self._pending:
            rid = rec["disagg_request_id"]
            complete = True
            for side, server in (("ctx_perf_metrics", rec["ctx_server"]), ("gen_perf_metrics", rec["gen_server"])):
                if rec[side] is not None or server is None:
                    continue
                found = self._exec.get(server, {}).pop(rid, None)
                if found is not None:
                    rec[side] = found
                    if side == "gen_perf_metrics":
                        self._observe_per_token(found)
                elif server in self._reporting:
                    complete = False
            if complete or now - received >= self.grace_s:
                self._ready_append(rec)
            else:
                waiting.append((received, rec))
        self._pending = waiting

    def _observe_per_token(self, item: dict[str, Any]) -> None:
        if self._row is None:
            return
        perf = item.get("perf_metrics") or {}
        timing = perf.get("timing_metrics") or {}
        first_iter, last_iter = perf.get("first_iter"), perf.get("last_iter")
        first, last = timing.get("first_token_time"), timing.get("last_token_time")
        if first_iter is None or last_iter is None:
            return
        with contextlib.suppress(TypeError, ValueError):
            steps = int(last_iter) - int(first_iter)
            if steps > 0 and last is not None and first is not None and last >= first:
                observe_into(self._row, "gen_per_token_latency_seconds", (float(last) - float(first)) / steps)

    def _ready_append(self, rec: dict[str, Any]) -> None:
        self._ready.append(rec)
        if len(self._ready) > self.max_requests:
            self._ready.popleft()
            self.dropped += 1

    # -- readers --------------------------------------------------------------------------

    async def read(self, drain: bool = True) -> list[dict[str, Any]]:
        """Poll the executors, join, and return the ready records (removing them if `drain`)."""
        if not self.enabled:
            return []
        await self.poll_executors()
        self.join()
        out = list(self._ready)
        if drain:
            self._ready.clear()
        return out

    @property
    def pending(self) -> int:
        return len(self._pending)

    def start(self) -> None:
        """Start polling the executors in the background (on the running loop); a store that
        keeps no records does not poll."""
        if not self.enabled:
            return
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0))
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        await stop_task(self._task)
        self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _run(self) -> None:
        """Keep the executors' buffers drained and the joins moving."""
        while True:
            await asyncio.sleep(POLL_S)
            try:
                await self.poll_executors()
                self.join()
            except Exception:  # keep polling; the next round retries
                log.exception("perf record polling failed")
