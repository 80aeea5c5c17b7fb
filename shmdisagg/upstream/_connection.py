"""One keep-alive HTTP/1.1 connection to an executor: an `asyncio.Protocol` fed by httptools.

Owns its transport, its response parser and the buffers of the response in flight. Knows nothing
of pooling policy: it calls back into its pool when it is made, lost or finished with
(`_on_conn_made`, `_on_conn_lost`, `_put_idle`). Everything runs on the event loop's thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

import httptools

from shmdisagg.upstream.errors import UpstreamDisconnected, UpstreamError, UpstreamProtocolError, UpstreamTimeout

if TYPE_CHECKING:
    from shmdisagg.upstream.pool import Body, UpstreamPool, _Host

# A response head larger than this is refused: executors send a handful of short headers.
MAX_HEAD_BYTES = 64 << 10


class StaleConnection(Exception):
    """A reused connection closed before any response byte: the keep-alive race (internal)."""


class _Stop(Exception):
    """Raised inside a parser callback to stop parsing; carries the error to fail with, if any."""

    def __init__(self, error: UpstreamError | None) -> None:
        super().__init__()
        self.error = error


class Connection(asyncio.Protocol):
    """A pooled connection; at most one request in flight (no pipelining).

    # per-connection
    pool, host: the owning pool and its per-(host, port) record.
    loop, transport, parser: the event loop, the socket transport, the response parser.
    max_body, high_water: the pool's body limit and the buffered-bytes mark that pauses reading.
    closed: True once the connection may not carry another request (closing or lost).
    served: responses completed on this connection; > 0 means it was reused from the pool.
    pooled, idle_since: whether it sits in the idle stack, and since when (loop.time(), s).

    # per-request
    busy: a request was written and its response not yet handed back or abandoned.
    head_fut: resolved when the response head is parsed (`whole`: when the response is complete);
        None once resolved or failed.
    deadline: the request's deadline (loop.time() s) bounding the wait for the head, or with
        `total` for the whole response; 0.0 when none is running.
    timer, timer_at: the connection's one call_at handle and when it fires (None: not armed). It
        outlives a request: a deadline ended is only set to 0.0, a later one leaves the timer where
        it is and the timer follows it when it fires (`_on_timer`), so a connection reused for
        many requests arms one timer per `deadline`'s length of time, not one per request (a
        call_at and its cancel cost 0.6 µs or more in uvloop, and each open one is a node of libuv's heap).
    whole, total: the request waits for the complete response; its deadline bounds the body too.
    no_body: the request was HEAD, so the response ends at its head.
    expect: no response has begun yet for the request in flight.
    status, headers: the response's status code and raw headers (names lower-cased).
    chunks, buffered: body bytes received and not yet taken by the consumer, and their total.
    body_total, rx_bytes: body bytes so far, and raw bytes received (head included).
    complete, keep_alive: the response ended; whether the connection may then be reused.
    error: why this response failed (raised to the consumer after the buffered bytes).
    waiter: a future the consumer sleeps on; woken by body, completion or error.
    collect: the consumer reads the whole body (`read()`): don't pause, don't wake per chunk.
    sink, pipe_fut: a consumer that takes each body piece as it is parsed (`pipe`), and the
        future resolved when the response ends (or fails: with `sink_error` if the sink raised).
    paused: reading from the transport is paused because `buffered` passed `high_water`.
    """

    __slots__ = (
        "pool", "host", "loop", "transport", "parser", "max_body", "high_water",
        "closed", "served", "pooled", "idle_since",
        "busy", "head_fut", "deadline", "timer", "timer_at", "whole", "total", "no_body", "expect", "status",
        "headers", "chunks", "buffered",
        "body_total", "rx_bytes", "complete", "keep_alive", "error", "waiter", "collect", "paused",
        "sink", "pipe_fut", "sink_error",
    )  # fmt: skip

    def __init__(self, pool: UpstreamPool, host: _Host, loop: asyncio.AbstractEventLoop) -> None:
        # per-connection
        self.pool = pool
        self.host = host
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.max_body = pool.max_response_bytes
        self.high_water = pool.read_high_water_bytes
        self.closed = False
        self.served = 0
        self.pooled = False
        self.idle_since = 0.0
        # per-request
        self.busy = False
        self.head_fut: asyncio.Future[None] | None = None
        self.deadline = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = 0.0
        self.whole = False
        self.total = False
        self.no_body = False
        self.expect = False
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.body_total = 0
        self.rx_bytes = 0
        self.complete = False
        self.keep_alive = False
        self.error: UpstreamError | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.collect = False
        self.paused = False
        self.sink: Callable[[bytes], None] | None = None
        self.pipe_fut: asyncio.Future[None] | None = None
        self.sink_error: BaseException | None = None

    # -- driven by the pool and the response ------------------------------------------------

    def start(
        self, data: Body, no_body: bool, deadline: float | None, whole: bool = False, total: bool = False
    ) -> asyncio.Future[None]:
        """Write one request (head and body already joined, or the pieces of `_Host.encode`) and
        return the head future (with `whole`, resolved once the response is complete, its body
        collected).

        `deadline` is in loop.time() seconds; past it the exchange fails with `UpstreamTimeout`:
        a response without its head, or with `whole` or `total` one not complete by then.
        """
        fut: asyncio.Future[None] = self.loop.create_future()
        self.head_fut = fut
        self.busy = True
        self.whole = whole
        self.total = whole or total
        self.no_body = no_body
        self.expect = True
        self.status = 0
        self.headers = []  # the previous response object keeps its own list
        self.body_total = 0
        self.rx_bytes = 0
        self.complete = False
        self.keep_alive = False
        self.collect = whole
        if deadline is not None:
            self._arm(deadline)
        else:
            self.deadline = 0.0
        if isinstance(data, bytes):
            self.transport.write(data)  # type: ignore[union-attr]  # set by connection_made
        else:
            self.transport.writelines(data)  # type: ignore[union-attr]
        return fut

    def take(self) -> bytes:
        """Hand over every buffered body byte (joined), and resume reading if it was paused."""
        chunks = self.chunks
        if not chunks:
            return b""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered = 0
        if self.paused:
            self.resume()
        return data

    def resume(self) -> None:
        self.paused = False
        if not self.closed and self.transport is not None:
            self.transport.resume_reading()

    def release(self) -> None:
        """The response was consumed to its end: pool the connection if it may be reused, else close."""
        self.busy = False
        self.deadline = 0.0
        if self.paused:
            self.resume()
        if self.keep_alive and not self.closed:
            self.served += 1
            self.pool._put_idle(self)
        else:
            self.close()

    def close(self) -> None:
        """Close gracefully (idle, or a finished response); idempotent."""
        if not self.closed:
            self.closed = True
            self._drop_timer()
            if self.transport is not None:
                self.transport.close()

    def abort(self, reason: str) -> None:
        """Drop the connection now; a response in flight fails with `UpstreamDisconnected`. Idempotent."""
        self.fail(UpstreamDisconnected(reason, self.rx_bytes))

    def fail(self, error: UpstreamError) -> None:
        """Record `error` for the response in flight (first one wins), wake its waiters, abort the socket."""
        if self.error is None:
            self.error = error
        fut = self.head_fut
        if fut is not None:
            self.head_fut = None
            if not fut.done():
                fut.set_exception(self.error)
        self._wake()
        self._drop_timer()
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.abort()

    def pipe(self, sink: Callable[[bytes], None]) -> asyncio.Future[None]:
        """Hand the body to `sink` as it arrives, from the read callback (the pieces of one read
        joined; those buffered so far at once, here), until the response ends; the future
        resolves then, or fails with the response's error (the sink's own exception if it raised:
        raised from here for the buffered pieces)."""
        fut: asyncio.Future[None] = self.loop.create_future()
        if self.chunks:
            sink(self.take())
        if self.error is not None:
            fut.set_exception(self.error)
        elif self.complete:
            fut.set_result(None)
        else:
            self.sink = sink
            self.pipe_fut = fut
        return fut

    def wait(self) -> asyncio.Future[None]:
        """A future resolved at the next body bytes (unless collecting), completion or error."""
        fut: asyncio.Future[None] = self.loop.create_future()
        self.waiter = fut
        return fut

    # -- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a TCP connection's: an asyncio.Transport
        self.pool._on_conn_made(self)

    def data_received(self, data: bytes) -> None:
        self.rx_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            stop = exc.__context__
            if isinstance(stop, _Stop) and stop.error is None:
                self.close()  # bytes after a complete response: keep what we have, reuse nothing
            elif isinstance(stop, _Stop) and stop.error is not None:
                self.fail(stop.error)
            else:
                self.fail(UpstreamProtocolError(f"response parser callback failed: {stop!r}"))
        except httptools.HttpParserError as exc:
            self.fail(UpstreamProtocolError(f"malformed response from {self.host.authority}: {exc}"))
        else:
            if self.status < 200 and self.head_fut is not None and self.rx_bytes > MAX_HEAD_BYTES:
                self.fail(
                    UpstreamProtocolError(f"response head from {self.host.authority} over {MAX_HEAD_BYTES} bytes")
                )
            elif self.sink is not None and self.chunks:
                self._deliver()  # a read's pieces joined: one hand-over (one client write) per read

    def _deliver(self) -> bool:
        """Hand the buffered body to the pipe's sink; False (and the response failed) if it raised."""
        sink = self.sink
        assert sink is not None
        try:
            sink(self.take())
        except Exception as exc:  # the consumer's fault: end the response with it
            self.sink_error = exc
            self.fail(UpstreamDisconnected("the response's consumer failed", self.rx_bytes))
            return False
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._drop_timer()
        self.pool._on_conn_lost(self)
        if not self.busy or self.error is not None or self.complete:
            return
        fut = self.head_fut
        if self.status >= 200 and exc is None and self._reads_until_close():
            self.complete = True  # a body framed by EOF (HTTP/1.0, or no length and not chunked)
            if fut is not None:  # `whole`: it is complete now
                self.head_fut = None
                if not fut.done():
                    fut.set_result(None)
        elif fut is not None:
            self.head_fut = None
            if self.rx_bytes == 0 and self.served > 0:
                error: Exception = StaleConnection()
            else:
                where = "mid-body" if self.status >= 200 else "before the response head"
                error = self.error = UpstreamDisconnected(
                    f"{self.host.authority} closed the connection {where}", self.rx_bytes
                )
            if not fut.done():
                fut.set_exception(error)
        else:
            self.error = UpstreamDisconnected(f"{self.host.authority} closed the connection mid-body", self.rx_bytes)
        self._wake()

    # -- httptools callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        if not self.expect:
            # A second response to one request, or bytes on an idle connection.
            raise _Stop(None if self.complete else UpstreamProtocolError("unexpected response"))
        self.expect = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self.status = self.parser.get_status_code()
        if status < 200:
            return  # interim 1xx; on_message_complete resets for the final response
        if self.no_body:
            self.complete = True  # HEAD: the parser would wait for a body; never reuse the socket
        elif self.whole:
            return  # resolved once the response is complete
        if not self.total or self.complete:
            self.deadline = 0.0  # else the deadline bounds the body too
        fut = self.head_fut
        if fut is not None:
            self.head_fut = None
            if not fut.done():
                fut.set_result(None)

    def on_body(self, body: bytes) -> None:
        n = len(body)
        total = self.body_total + n
        if total > self.max_body:
            raise _Stop(UpstreamProtocolError(f"response body from {self.host.authority} over {self.max_body} bytes"))
        self.body_total = total
        self.chunks.append(body)
        self.buffered += n
        if not self.collect:
            if self.waiter is not None:
                self._wake()
            if self.buffered > self.high_water and not self.paused:
                self.paused = True
                self.transport.pause_reading()  # type: ignore[union-attr]  # set by connection_made

    def on_message_complete(self) -> None:
        if self.status < 200:
            self.headers = []
            self.expect = True
            return
        if self.no_body:
            return
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        if self.total:
            self.deadline = 0.0
            fut = self.head_fut
            if fut is not None:  # `whole`: the response is complete
                self.head_fut = None
                if not fut.done():
                    fut.set_result(None)
        self._wake()

    # -- helpers --------------------------------------------------------------------------

    def _wake(self) -> None:
        w = self.waiter
        if w is not None:
            self.waiter = None
            if not w.done():
                w.set_result(None)
        p = self.pipe_fut
        if p is not None and (self.complete or self.error is not None):
            if self.chunks and self.sink_error is None and not self._deliver():
                return  # failed: _deliver's fail() woke the pipe with the sink's error
            self.pipe_fut = self.sink = None
            if not p.done():
                if self.error is None:
                    p.set_result(None)
                else:
                    p.set_exception(self.sink_error or self.error)

    def _arm(self, deadline: float) -> None:
        """Make `deadline` the request's; the timer moves only if it would fire too late."""
        self.deadline = deadline
        if self.timer is None or self.timer_at > deadline:
            if self.timer is not None:
                self.timer.cancel()
            self.timer = self.loop.call_at(deadline, self._on_timer)
            self.timer_at = deadline

    def _drop_timer(self) -> None:
        """The connection carries no more requests: cancel its timer (it would hold it until then)."""
        self.deadline = 0.0
        t = self.timer
        if t is not None:
            self.timer = None
            t.cancel()

    def _on_timer(self) -> None:
        self.timer = None
        deadline = self.deadline
        if not deadline:
            return  # the request it was armed for ended; the next one arms it again
        if self.loop.time() < deadline - 0.001:  # a later request's deadline: follow it
            self.timer = self.loop.call_at(deadline, self._on_timer)
            self.timer_at = deadline
            return
        self.deadline = 0.0
        self._on_timeout()

    def _on_timeout(self) -> None:
        if self.head_fut is not None and self.status < 200:
            self.fail(UpstreamTimeout(f"no response head from {self.host.authority} before the deadline"))
        elif self.busy and not self.complete:
            self.fail(UpstreamTimeout(f"the response from {self.host.authority} did not complete before the deadline"))

    def _reads_until_close(self) -> bool:
        for name, _ in self.headers:
            if name == b"content-length" or name == b"transfer-encoding":
                return False
        return True
