"""The request path's metrics: what one fleet worker counts per request, in its own row.

`RequestMetrics.serve` wraps `DisaggService.handle` for the two hot routes: it counts the request,
and puts a `Note` in a context variable for the request's task (uvicorn runs each request in its
own task, and the legs' tasks copy the context). `CountingPolicy` (around each role's routing
policy) and `CountingAdmission` write what they see into that note; `RequestMetrics.sink`, one of
`DisaggService.sinks`, turns the note and the finished `Exchange` into counter and histogram
updates, and hands the per-request record to the `RecordShipper` (which sends it to the
coordinator off the request path).

Cost per request: about twenty memoryview adds and the record tuple, 5.6-9.4 us of CPU on the
project's VM against 42-48 us for the same updates through prometheus-client's multiprocess mode
(`benchmarks/bench_metrics.py micro`, BENCHMARKS.md).
Never blocks, never raises into the request (a metrics bug must not fail a request).
"""

from __future__ import annotations

import logging
import os
import time
from bisect import bisect_left
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any, Protocol

from shmdisagg.metrics.schema import LAYOUT, MAX_SERVERS
from shmdisagg.orchestrator.exchange import Exchange
from shmdisagg.orchestrator.service import Admission

log = logging.getLogger("shmdisagg.metrics")

CLIENT_DISCONNECTED = "client_disconnected"
INTERNAL_ERROR = "internal_error"


class Note:
    """What the routing and admission wrappers saw during one request.

    `routed`: the sink ran (the request got an Exchange); `rejected`: admission said no;
    `ctx_ok`/`gen_ok`: successful picks per role (more than one: retries); `ctx_none`/`gen_none`:
    picks that found no eligible server; `gen_dispatch`: wall time of the first generation pick.
    """

    __slots__ = ("routed", "rejected", "ctx_ok", "ctx_none", "gen_ok", "gen_none", "gen_dispatch")

    def __init__(self) -> None:
        self.routed = False
        self.rejected = False
        self.ctx_ok = self.ctx_none = self.gen_ok = self.gen_none = 0
        self.gen_dispatch = 0.0


NOTE: ContextVar[Note | None] = ContextVar("shmdisagg_request_note", default=None)


class _Policy(Protocol):
    name: str

    def pick(self, key: Any, exclude_slot: int) -> int: ...

    def release(self, slot: int, key: Any) -> None: ...


class CountingPolicy:
    """A routing policy with this request's picks noted; everything else is the policy's own."""

    def __init__(self, inner: _Policy, generation: bool) -> None:
        self.inner = inner
        self.name = inner.name
        self._generation = generation

    def __getattr__(self, attr: str) -> Any:  # needs_tokens, on_finish, ... of the policy
        return getattr(self.inner, attr)

    def pick(self, key: Any, exclude_slot: int) -> int:
        slot = self.inner.pick(key, exclude_slot)
        note = NOTE.get()
        if note is not None:
            if self._generation:
                if slot < 0:
                    note.gen_none += 1
                else:
                    note.gen_ok += 1
                    if not note.gen_dispatch:
                        note.gen_dispatch = time.time()
            elif slot < 0:
                note.ctx_none += 1
            else:
                note.ctx_ok += 1
        return slot

    def release(self, slot: int, key: Any) -> None:
        self.inner.release(slot, key)


class CountingAdmission(Admission):
    """`Admission` that notes a rejection for the request's metrics."""

    def admit(self) -> bool:
        if super().admit():
            return True
        note = NOTE.get()
        if note is not None:
            note.rejected = True
        return False


class RecordSink(Protocol):
    def add(self, record: tuple[Any, ...]) -> None: ...


class RequestMetrics:
    """Counts into one metrics row (`row`, float64 words laid out by `schema.LAYOUT`).

    `records`: where per-request records go (None: none are kept)."""

    def __init__(self, row: memoryview[float], records: RecordSink | None = None) -> None:
        self.row = row
        self.records = records
        row[LAYOUT.pid] = os.getpid()  # lets `shmdisagg stats` match the row to the table's
        c = LAYOUT.counter
        self._total = c["total_requests"]
        self._rejections = c["shmdisagg_admission_rejections"]
        self._validation = c["validation_exceptions"]
        self._edge_refusals = c["shmdisagg_edge_refusals"]

    def edge_refused(self) -> None:
        """The public port refused a request before any route saw it (`fleet/edge.py`: 400, 408,
        413 or 431); it is not in `total_requests`, as no route received it."""
        self.row[self._edge_refusals] += 1.0

    async def serve(self, handle: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Run `handle(*args)` for one hot-route request (ASGI's `scope, receive, send, chat`, or a
        `HotCycle`), counting it."""
        row = self.row
        row[self._total] += 1.0
        note = Note()
        token = NOTE.set(note)
        try:
            await handle(*args)
        finally:
            NOTE.reset(token)
            if not note.routed:  # refused before routing: no Exchange, no sink call
                row[self._rejections if note.rejected else self._validation] += 1.0

    def sink(self, ex: Exchange) -> None:
        """`DisaggService` sink: called once per routed request at its end."""
        try:
            self._count(ex)
        except Exception:  # pragma: no cover - a metrics bug must never fail a request
            log.exception("metrics sink failed for request %d", ex.disagg_request_id)

    def _count(self, ex: Exchange) -> None:
        row = self.row
        note = NOTE.get()
        if note is None:  # a service driven without `serve` (tests): derive what we can
            note = Note()
            note.ctx_ok = int(ex.ctx_slot >= 0)
            note.gen_ok = int(ex.gen_slot >= 0)
        note.routed = True
        code = ex.error_code
        failed = bool(code) and code != CLIENT_DISCONNECTED

        row[_STREAM if ex.stream else _NONSTREAM] += 1.0
        if not code:
            row[_RESPONSES] += 1.0
        elif code == CLIENT_DISCONNECTED:
            row[_DISCONNECTS] += 1.0
        elif code == INTERNAL_ERROR:
            row[_INTERNAL] += 1.0
        else:
            row[_HTTP_EXC] += 1.0
            if 400 <= ex.status < 500:  # the client's fault, though it passed validation: `stats` shows it as 4xx
                row[_ROUTED_4XX] += 1.0

        ctx_ok, gen_ok = note.ctx_ok, note.gen_ok
        ctx_retries = gen_retries = 0
        if ctx_ok:
            row[_CTX_TOTAL] += ctx_ok
            row[_CTX_ROUTED] += 1.0
            if ctx_ok > 1:
                ctx_retries = ctx_ok - 1
                row[_CTX_RETRY] += ctx_retries
                row[_CTX_RETRY_D] += ctx_retries
        if note.ctx_none:
            row[_CTX_NONE] += note.ctx_none
        if gen_ok:
            row[_GEN_TOTAL] += gen_ok
            row[_GEN_ROUTED] += 1.0
            if gen_ok > 1:
                gen_retries = gen_ok - 1
                row[_GEN_RETRY] += gen_retries
                row[_GEN_RETRY_D] += gen_retries
        if note.gen_none:
            row[_GEN_NONE] += note.gen_none

        arrival, ctx_dispatch, ctx_done = ex.arrival, ex.ctx_dispatch, ex.ctx_done
        first, last = ex.first_token, ex.last_token
        if ctx_dispatch:
            _observe(row, _H_QUEUE, ctx_dispatch - arrival)
            if ctx_done:
                row[_CTX_DONE] += 1.0
                took = ctx_done - ctx_dispatch
                _observe(row, _H_CTX_FIRST, took)
                _observe(row, _H_CTX_COMPLETE, took)
            elif failed and ctx_ok:
                row[_CTX_ERR] += 1.0
        gen_dispatch = note.gen_dispatch
        if gen_ok:
            if failed:
                row[_GEN_ERR] += 1.0
            elif last and not code:
                row[_GEN_DONE] += 1.0
            if gen_dispatch and first > gen_dispatch:
                _observe(row, _H_GEN_FIRST, first - gen_dispatch)
                if last and not code:
                    _observe(row, _H_GEN_COMPLETE, last - gen_dispatch)
        if first:
            _observe(row, _H_TTFT, first - arrival)
            if last and not code:
                _observe(row, _H_E2E, last - arrival)

        # The fleet worker's own time: before the first leg went out, and between the context
        # answer and the next step (the generation dispatch, or the answer built from context).
        first_out = ctx_dispatch or gen_dispatch
        if first_out:
            overhead = first_out - arrival
            if ctx_done:
                nxt = gen_dispatch if gen_ok else first
                if nxt > ctx_done:  # generation-first dispatches before the context answer
                    overhead += nxt - ctx_done
            _observe(row, _H_OVERHEAD, overhead)

        slot = ex.ctx_slot
        if 0 <= slot < MAX_SERVERS and ex.prompt_tokens:
            row[_PROMPT0 + slot] += ex.prompt_tokens
            row[_CACHED0 + slot] += ex.cached_tokens

        if self.records is not None:
            self.records.add(
                (
                    ex.disagg_request_id,
                    arrival,
                    ctx_dispatch,
                    ctx_done,
                    gen_dispatch,
                    first,
                    last,
                    slot,
                    ex.gen_slot,
                    ex.prompt_tokens,
                    ex.cached_tokens,
                    max(ex.retries, ctx_retries + gen_retries),
                    ex.status,
                    code,
                    ex.stream,
                )
            )

    def _observe(self, name: str, value: float) -> None:
        observe_into(self.row, name, value)


# Word offsets, resolved once: the sink runs on every request.
_C = LAYOUT.counter
(
    _STREAM,
    _NONSTREAM,
    _RESPONSES,
    _DISCONNECTS,
    _ROUTED_4XX,
    _INTERNAL,
    _HTTP_EXC,
    _CTX_TOTAL,
    _CTX_RETRY,
    _CTX_DONE,
    _CTX_ERR,
    _GEN_TOTAL,
    _GEN_RETRY,
    _GEN_DONE,
    _GEN_ERR,
) = (
    _C[n]
    for n in (
        "stream_requests",
        "nonstream_requests",
        "total_responses",
        "shmdisagg_client_disconnects",
        "shmdisagg_routed_client_errors",
        "internal_errors",
        "http_exceptions",
        "ctx_total_requests",
        "ctx_retry_requests",
        "ctx_completed_requests",
        "ctx_error_requests",
        "gen_total_requests",
        "gen_retry_requests",
        "gen_completed_requests",
        "gen_error_requests",
    )
)
_R = LAYOUT.routing
_CTX_ROUTED, _CTX_RETRY_D, _CTX_NONE = (_R[("context", o)] for o in ("routed", "retry", "no_server"))
_GEN_ROUTED, _GEN_RETRY_D, _GEN_NONE = (_R[("generation", o)] for o in ("routed", "retry", "no_server"))
_PROMPT0 = LAYOUT.per_server["shmdisagg_server_prompt_tokens"]
_CACHED0 = LAYOUT.per_server["shmdisagg_server_cached_tokens"]


def _hist(name: str) -> tuple[int, tuple[float, ...], int]:
    base, bounds = LAYOUT.hist[name], LAYOUT.bounds[name]
    return base, bounds, base + len(bounds) + 1


(_H_QUEUE, _H_CTX_FIRST, _H_CTX_COMPLETE, _H_GEN_FIRST, _H_GEN_COMPLETE, _H_TTFT, _H_E2E, _H_OVERHEAD) = (
    _hist(n)
    for n in (
        "queue_latency_seconds",
        "ctx_first_token_latency_seconds",
        "ctx_complete_latency_seconds",
        "gen_first_token_latency_seconds",
        "gen_complete_latency_seconds",
        "shmdisagg_time_to_first_token_seconds",
        "shmdisagg_e2e_request_latency_seconds",
        "shmdisagg_orchestrator_overhead_seconds",
    )
)


def _observe(row: memoryview[float], hist: tuple[int, tuple[float, ...], int], value: float) -> None:
    base, bounds, total = hist
    row[base + bisect_left(bounds, value)] += 1.0
    row[total] += value


# field order of the record tuple above (the coordinator's `perf.py` names them)
RECORD_FIELDS = (
    "disagg_request_id",
    "arrival",
    "ctx_dispatch",
    "ctx_done",
    "gen_dispatch",
    "first_token",
    "last_token",
    "ctx_slot",
    "gen_slot",
    "prompt_tokens",
    "cached_tokens",
    "retries",
    "status",
    "error_code",
    "stream",
)


def observe_into(row: memoryview[float], name: str, value: float) -> None:
    """One histogram observation into `row` (the coordinator's per-token latency)."""
    _observe(row, _hist(name), value)
